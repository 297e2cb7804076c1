"""Which model ``verify --parity`` (and token drift) loads on this machine.

The served model's *name* is not a place: hsx serves a local model under its directory's
name (``/models/llama`` is ``llama``), so loading that name from the working directory
finds whatever ``./llama`` happens to be there, and parity then reports the stored
states as wrong. So:

- ``--parity-model`` is used as given;
- without it, the served name is used only where it cannot be mistaken: a directory
  of that name whose weights are the run's (their SHA-256 is the one ``job.json``
  recorded from the server's provenance), or a Hugging Face id (no such directory
  here, and no weights hash recorded: a server given a hub id records none);
  anything else is refused with one line asking for ``--parity-model``;
- whatever is chosen, a run that records its weights' SHA-256 must match it: a
  directory is hashed before loading (``service.engine.provenance.weights_sha256``,
  cached per file beside the weights as the server caches it), a Hugging Face id once
  transformers has downloaded it (its snapshot in the local cache).
"""

from __future__ import annotations

from pathlib import Path

from service.dataset.manifest import WEIGHTS, Job
from service.dataset.store import RunStore


class ParityError(Exception):
    """Parity cannot run (no model to load, an unknown dtype or codec). Defined here, where
    the model is chosen, and raised by ``service.dataset.parity`` too."""


ASK = "pass --parity-model with the served model's directory or Hugging Face id"


def recorded_weights(runs: list[tuple[RunStore, Job]]) -> str | None:
    """The weights' SHA-256 the run's ``job.json`` files record (None: none does).

    Raises ParityError when its shards record different weights.
    """
    hashes = sorted({h for _, job in runs if (h := job.provenance.get(WEIGHTS)) is not None})
    if len(hashes) > 1:
        shown = ", ".join(h[:16] + "..." for h in hashes)
        raise ParityError(
            f"the run's shards record different weights ({shown}); "
            "verify each shard's directory on its own"
        )
    return hashes[0] if hashes else None


def choose_model(given: str | None, runs: list[tuple[RunStore, Job]]) -> str:
    """The path or Hugging Face id to load for ``runs`` (see the module docstring).

    Raises ParityError, one line, when no model can be chosen or the chosen
    directory's weights are not the run's.
    """
    recorded = recorded_weights(runs)
    if given is not None:
        if Path(given).is_dir():
            check_weights(Path(given), recorded)
        return given
    served = runs[0][1].fingerprint.model
    if Path(served).exists():
        if recorded is None or not Path(served).is_dir():
            raise ParityError(
                f"{served!r} here shares the served model's name, and the run records no "
                f"weights SHA-256 to tell whether it is that model; {ASK}"
            )
        check_weights(Path(served), recorded)
        return served
    if recorded is not None:  # the server loaded a directory that is not here
        raise ParityError(
            f"the server serves {served!r} from its own directory (weights SHA-256 "
            f"{recorded[:16]}...), which is not {served!r} here; {ASK}"
        )
    return served  # a Hugging Face id, as the server was given it


def check_weights(directory: Path, recorded: str | None) -> None:
    """ParityError unless ``directory``'s weights are the run's (no record: no check)."""
    if recorded is None:
        return
    import tempfile

    from service.engine.provenance import weights_sha256

    # The cache goes beside the weights as the server's does; where that is read-only,
    # under the temporary directory, not into the caller's working directory.
    found = weights_sha256(directory, Path(tempfile.gettempdir()) / "hsx-weights-sha256")
    if found != recorded:
        what = f"SHA-256 {found[:16]}..." if found else "no weight files"
        raise ParityError(
            f"{directory}: its weights ({what}) are not the run's ({recorded[:16]}..., "
            f"job.json's provenance); {ASK}"
        )


def check_downloaded(model: str, recorded: str | None) -> None:
    """For a Hugging Face id just loaded: its cached snapshot's weights are the run's."""
    if recorded is None or Path(model).is_dir():
        return  # a directory was checked before loading
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not in the local cache (transformers found it elsewhere)
        raise ParityError(
            f"{model}: cannot find its files to compare their weights with the run's "
            f"({recorded[:16]}...); {ASK}"
        ) from None
    check_weights(snapshot, recorded)
