"""What the trainer-export tests share: a chat run with loss masks made by a real
``hsx serve``, the export command as users run it, and the transformers reference at
a layout's layers and norm side."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from service.cli import main
from service.dataset import RunOptions, run_dataset
from tests.dataset.served_runs import ServedRun
from tests.dataset.synth import conversation
from tests.engine.reference import load, relative_error

#: Largest relative error of an exported tensor against transformers' float32 forward.
BOUND = 1e-5


def chat_run(url: str, storage: Path, model: Path, root: Path, rows: int) -> ServedRun:
    """``rows`` two-turn chats run with loss masks on the assistant turns."""
    rng = random.Random(11)
    chats = [{"messages": conversation(rng, 2, (3, 8))} for _ in range(rows)]
    source = root / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in chats))
    output = root / "run"
    options = RunOptions(
        input=str(source), endpoints=[url], output=str(output), progress=False, loss="assistant"
    )
    summary = run_dataset(options)
    assert summary.complete, summary
    assert summary.ok == rows, summary
    return ServedRun(url, storage, output, model, chats)


def export(
    capsys: pytest.CaptureFixture[str], run: ServedRun, output: Path, dest: Path, *flags: str
) -> tuple[int, str]:
    """``hsx dataset export OUTPUT DEST --endpoint URL FLAGS`` in this process: its exit
    code, and what it printed (stdout, then stderr; nothing printed before it)."""
    capsys.readouterr()
    code = main(["dataset", "export", str(output), str(dest), "--endpoint", run.url, *flags])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def manifest(dest: Path) -> dict[str, Any]:
    return dict(json.loads((dest / "hsx-export.json").read_text()))


def lengths(dest: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (dest / "lengths.jsonl").read_text().splitlines()]


def forward(model: Path, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' ``hidden_states`` in float32: entry ``i < L`` is hsx id ``i``, entry
    ``L`` is the last layer's output *after* the final norm."""
    with torch.no_grad():
        out = load(str(model))(torch.tensor([token_ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def before_norm(model: Path, token_ids: list[int]) -> torch.Tensor:
    """The last decoder layer's output before the final norm (hsx id L), by a hook."""
    hf = load(str(model))
    captured: dict[str, torch.Tensor] = {}

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            hf(torch.tensor([token_ids]))
    finally:
        handle.remove()
    return captured["last"][0]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, worst: list[float]) -> None:
    """Assert ``actual`` is within BOUND of ``expected`` (relative), recording the error."""
    assert actual.shape == expected.shape, (
        f"{what}: {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    error = relative_error(actual.float(), expected)
    worst.append(error)
    assert error <= BOUND, f"{what}: relative error {error:.3g} > {BOUND}"


def aux_reference(states: tuple[torch.Tensor, ...], hsx_ids: list[int]) -> torch.Tensor:
    """The aux layers concatenated in order, as the layouts store them."""
    return torch.cat([states[i] for i in hsx_ids], dim=-1)
