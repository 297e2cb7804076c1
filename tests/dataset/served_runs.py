"""Runs made by a real ``hsx serve``, and ways to corrupt them past the server's checks.

One server per model for a whole test module (starting vLLM is the cost); each test
that tampers with an object restores it, and edits the manifest of its own copy of
the run, so the module's tests stay independent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.dataset import RunOptions, run_dataset
from tests.dataset.synth import conversation

#: Token-id rows of these lengths, then as many one-turn conversations.
LENGTHS = (4, 9, 17, 30, 48, 70)


@dataclass
class ServedRun:
    """A finished run and the server (and storage directory) that made it."""

    url: str
    storage: Path
    output: Path
    model: Path
    rows: list[dict[str, Any]]

    def records(self, output: Path | None = None) -> dict[int, dict[str, Any]]:
        """The last manifest line of each row."""
        lines = ((output or self.output) / "manifest.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        return {r["row"]: r for r in records}

    def copy(self, dest: Path) -> Path:
        """The run's state (not its objects) in ``dest``, for a test to edit."""
        shutil.copytree(self.output, dest)
        return dest


def dataset_rows(vocab: int, seed: int = 5) -> list[dict[str, Any]]:
    """Token-id rows spread over lengths, and short chats."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = [
        {"token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in LENGTHS
    ]
    rows += [{"messages": conversation(rng, 1, (2, 5))} for _ in LENGTHS]
    return rows


def make_run(url: str, storage: Path, model: Path, root: Path, vocab: int) -> ServedRun:
    """Run the dataset against ``url`` into ``root / "run"``."""
    rows = dataset_rows(vocab)
    source = root / "input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = root / "run"
    options = RunOptions(
        input=str(source), endpoints=[url], output=str(output), progress=False, batch_size=4
    )
    summary = run_dataset(options)
    assert summary.complete, summary
    assert summary.ok == len(rows), summary
    return ServedRun(url, storage, output, model, rows)


def served_env(storage: Path) -> dict[str, str]:
    """A small CPU engine (float32) writing to a local directory."""
    return {
        "HSX_ENGINE__DTYPE": "float32",
        "HSX_ENGINE__MAX_MODEL_LEN": "256",
        "HSX_ENGINE__EXTRA_ARGS": '{"enforce_eager": true}',
        "HSX_ENGINE__CPU_KVCACHE_SPACE_GIB": "1",
        "HSX_STORAGE__URL": str(storage),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }


def verify(
    capsys: pytest.CaptureFixture[str], run: ServedRun, output: Path, *flags: str
) -> tuple[int, str]:
    """``hsx dataset verify`` in this process: exit code, stdout and stderr."""
    code = main(["dataset", "verify", str(output), "--endpoint", run.url, *flags])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def load_object(data: bytes) -> tuple[dict[str, Any], dict[str, str]]:
    """A raw object's tensors and ``__metadata__``."""
    from safetensors.torch import load

    (length,) = __import__("struct").unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    return dict(load(data)), metadata


@contextlib.contextmanager
def tampered(
    run: ServedRun,
    output: Path,
    row: int,
    change: Callable[[dict[str, Any], dict[str, str]], None],
) -> Iterator[dict[str, Any]]:
    """Rewrite row ``row``'s object in storage with ``change(tensors, metadata)`` applied,
    and append a manifest line to ``output`` (a copy of the run) with its new SHA-256 and
    token count, so that only checks of the states themselves can tell; restored after."""
    from safetensors.torch import save

    record = run.records(output)[row]
    path = run.storage / record["key"]
    original = path.read_bytes()
    tensors, metadata = load_object(original)
    change(tensors, metadata)
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    fixed = {
        **record,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "num_tokens": int(tensors["token_ids"].shape[0]),
    }
    with (output / "manifest.jsonl").open("a") as manifest:
        manifest.write(json.dumps(fixed) + "\n")
    path.write_bytes(data)
    try:
        yield fixed
    finally:
        path.write_bytes(original)


def numpy_statistics(objects: list[bytes]) -> list[dict[str, float]]:
    """The statistics of ``statistics.json`` computed by numpy over the objects."""
    import numpy as np
    from safetensors.numpy import load

    x = np.concatenate([load(data)["hidden_states"] for data in objects]).astype(np.float64)
    norms = np.linalg.norm(x, axis=-1)
    return [
        {
            "values": x[:, j].size,
            "token_rows": x.shape[0],
            "mean": float(x[:, j].mean()),
            "std": float(x[:, j].std()),
            "mean_abs": float(np.abs(x[:, j]).mean()),
            "max_abs": float(np.abs(x[:, j]).max()),
            "mean_token_norm": float(norms[:, j].mean()),
            "non_finite_fraction": float((~np.isfinite(x[:, j])).mean()),
            "zero_row_fraction": float((norms[:, j] == 0).mean()),
        }
        for j in range(x.shape[1])
    ]
