"""What an export needs from the target model, and from the run's layer convention.

The model is ``--model`` (a directory or a Hugging Face id), else the run's own, as
``verify --parity`` chooses it (``service.dataset.model_choice``: a directory of the
served name only when its weights' SHA-256 is the one the run recorded); a directory
given whose weights are not the run's is refused, so a norm is never taken from
another checkpoint. From it: ``num_hidden_layers`` (the last layer's id, the trainers'
default aux layers), ``vocab_size`` (``t2d``'s length) and, only when a layout wants
the last layer after the final norm, the norm itself (``service.dataset.final_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.dataset.final_norm import FinalNorm, NormError, load_final_norm, text_config
from service.dataset.layouts import ExportError
from service.dataset.manifest import Job
from service.dataset.store import RunStore

ASK = "pass --model with the served model's directory or Hugging Face id"
#: The words of ``hsx.provenance.layer_convention`` that say where the last layer is.
BEFORE, AFTER = "before the final norm", "after the final norm"


def objects_side(convention: str | None, where: str) -> str:
    """``before`` or ``after``: the final-norm side of the last layer that objects of
    this layer convention hold. hsx has stored it before the norm since its first
    objects, so none stated (an older server) reads as ``before``. ExportError for a
    convention that says neither."""
    if convention is None:
        return "before"
    has_before, has_after = BEFORE in convention, AFTER in convention
    if has_before != has_after:
        return "before" if has_before else "after"
    raise ExportError(
        f"{where}: its layer convention does not say on which side of the final norm the "
        f"last layer is ({convention!r}); hsx cannot export it"
    )


@dataclass
class ModelFacts:
    """The target model's directory and what an export reads from it (all None when
    the export needs no model)."""

    path: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    _norm: FinalNorm | None = None

    @property
    def num_layers(self) -> int | None:
        value = self.config.get("num_hidden_layers")
        return int(value) if isinstance(value, int) else None

    @property
    def vocab_size(self) -> int | None:
        value = self.config.get("vocab_size")
        return int(value) if isinstance(value, int) else None

    @property
    def norm(self) -> FinalNorm | None:
        """The final norm, read on first use; ExportError (one line) if it cannot be."""
        if self._norm is None and self.path is not None:
            try:
                self._norm = load_final_norm(Path(self.path))
            except NormError as exc:
                raise ExportError(str(exc)) from None
        return self._norm


def resolve_model(
    given: str | None, runs: list[tuple[RunStore, Job]], needed: bool, vocab_map: int | None
) -> ModelFacts:
    """The model facts of an export (module docstring); none when nothing needs them."""
    if not needed and vocab_map is None and given is None:
        return ModelFacts()
    path = _locate(given, runs)
    try:
        facts = ModelFacts(str(path), text_config(path))
    except NormError as exc:
        raise ExportError(str(exc)) from None
    if facts.num_layers is None:
        raise ExportError(f"{path}/config.json: no num_hidden_layers")
    if vocab_map is not None:
        if facts.vocab_size is None:
            raise ExportError(f"{path}/config.json: no vocab_size for --vocab-map")
        if not 0 < vocab_map <= facts.vocab_size:
            raise ExportError(f"--vocab-map {vocab_map}: must be 1..{facts.vocab_size}")
    return facts


def _locate(given: str | None, runs: list[tuple[RunStore, Job]]) -> Path:
    """The model's directory: chosen as for parity, then a hub id's cached snapshot."""
    from service.dataset.model_choice import ASK as PARITY_ASK
    from service.dataset.model_choice import (
        ParityError,
        check_weights,
        choose_model,
        recorded_weights,
    )

    try:
        chosen = choose_model(given, runs)
        if Path(chosen).is_dir():
            return Path(chosen)
        from huggingface_hub import snapshot_download

        patterns = ["config.json", "*.safetensors", "*.safetensors.index.json"]
        snapshot = Path(snapshot_download(chosen, allow_patterns=patterns))
        check_weights(snapshot, recorded_weights(runs))
        return snapshot
    except ParityError as exc:
        raise ExportError(str(exc).replace(PARITY_ASK, ASK)) from None
    except OSError as exc:  # huggingface_hub's errors (offline, unknown id) are OSErrors
        raise ExportError(
            f"{given or 'the served model'}: cannot fetch its files ({exc}); {ASK}"
        ) from None
