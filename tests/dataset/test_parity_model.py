"""Which model ``verify --parity`` loads (issue 58, L2): never a directory that merely
shares the served model's name, and never weights other than the run's.

The run is a stand-in's (its ``/v1/models`` card says what the run records); the
models are real tiny checkpoints on disk, ``./tiny`` in the working directory named
like the served model. Refusals come before any object is read, so no engine is
needed; ``tests/dataset/test_parity.py`` runs parity itself on a real server's run."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.dataset import RunOptions, run_dataset
from service.dataset.model_choice import choose_model
from service.dataset.store import RunStore
from service.dataset.verify import run_stores
from service.engine.provenance import weights_sha256
from service.engine.tiny_models import make_model
from tests.dataset.cli_runs import write_input
from tests.dataset.standins import MODEL, stored

ASK = "pass --parity-model with the served model's directory or Hugging Face id"


@pytest.fixture
def served(model_dir: Any) -> Path:
    """The served model (the stand-in's card names it ``tiny``)."""
    return Path(model_dir("llama"))


def make_run(tmp_path: Path, servers: Any, weights: str | None) -> tuple[str, str]:
    """A finished stand-in run recording ``weights`` (or no weights hash): (output, url)."""
    server = servers(stored)
    if weights is not None:
        server.model["provenance"] = {"weights_sha256": weights}
    source = write_input(tmp_path / "rows.jsonl", ['{"token_ids": [3, 4, 5]}'])
    output = tmp_path / "run"
    options = RunOptions(input=str(source), endpoints=[server.url], output=str(output),
                         progress=False)  # fmt: skip
    assert run_dataset(options).ok == 1
    return str(output), server.url


def verify(
    capsys: pytest.CaptureFixture[str], output: str, url: str, *flags: str
) -> tuple[int, list[str]]:
    capsys.readouterr()  # what came before (a model being written) is not verify's
    code = main(["dataset", "verify", output, "--endpoint", url, "--parity", "1", *flags])
    return code, capsys.readouterr().err.splitlines()


def other_weights(where: Path) -> Path:
    """A checkpoint of the same shape and other weights (another seed) at ``where``."""
    return make_model(where, "llama", seed=1)


def test_a_directory_named_like_the_served_model_with_other_weights_is_refused(
    tmp_path: Path, servers: Any, served: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    recorded = weights_sha256(served)
    output, url = make_run(tmp_path, servers, recorded)
    monkeypatch.chdir(other_weights(tmp_path / "cwd" / MODEL["id"]).parent)
    found = weights_sha256(Path(MODEL["id"]))
    code, err = verify(capsys, output, url)
    assert code == 2
    assert err == [
        f"hsx dataset: error: {MODEL['id']}: its weights (SHA-256 {found[:16]}...) are not the "
        f"run's ({recorded[:16]}..., job.json's provenance); {ASK}"
    ]
    assert not (Path(output) / "parity.json").exists()
    # Named with --parity-model, the same directory is refused the same way.
    code, err = verify(capsys, output, url, "--parity-model", str(Path(MODEL["id"]).resolve()))
    assert code == 2
    assert f"its weights (SHA-256 {found[:16]}...) are not the run's" in err[0]


def test_without_a_recorded_hash_a_same_named_directory_is_not_trusted(
    tmp_path: Path, servers: Any, served: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    output, url = make_run(tmp_path, servers, weights=None)
    shutil.copytree(served, tmp_path / "cwd" / MODEL["id"])  # even the right weights
    monkeypatch.chdir(tmp_path / "cwd")
    code, err = verify(capsys, output, url)
    assert code == 2
    assert err == [
        f"hsx dataset: error: {MODEL['id']!r} here shares the served model's name, and the run "
        f"records no weights SHA-256 to tell whether it is that model; {ASK}"
    ]


def test_a_served_directory_that_is_not_here_asks_for_parity_model(
    tmp_path: Path, servers: Any, served: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    recorded = weights_sha256(served)
    output, url = make_run(tmp_path, servers, recorded)
    monkeypatch.chdir(tmp_path)
    code, err = verify(capsys, output, url)
    assert code == 2
    assert err == [
        f"hsx dataset: error: the server serves {MODEL['id']!r} from its own directory "
        f"(weights SHA-256 {recorded[:16]}...), which is not {MODEL['id']!r} here; {ASK}"
    ]


def test_the_served_name_is_used_when_its_weights_are_the_run_s(
    tmp_path: Path, servers: Any, served: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output, _ = make_run(tmp_path, servers, weights_sha256(served))
    shutil.copytree(served, tmp_path / "cwd" / MODEL["id"])
    monkeypatch.chdir(tmp_path / "cwd")
    runs = asyncio.run(run_stores(RunStore(output)))
    assert choose_model(None, runs) == MODEL["id"]
    assert choose_model(str(served), runs) == str(served)
