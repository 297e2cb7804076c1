"""The Hugging Face transformers reference for stored hidden states."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch


@cache
def load(model_path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of ``model_path`` in ``dtype`` (float32 unless told), once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def reference_states(
    model_path: str,
    token_ids: list[int],
    layer_ids: list[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[num_tokens, len(layer_ids), hidden] as transformers computes them in ``dtype``.

    Id i < L is ``output_hidden_states[i]`` (the input of decoder layer i); id L is the
    output of the last decoder layer, before the final norm (transformers' last entry
    is after the norm), captured with a forward hook.
    """
    model = load(model_path, dtype)
    captured: dict[str, torch.Tensor] = {}

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    num_layers = len(model.model.layers)
    states = [
        captured["last"][0] if i == num_layers else out.hidden_states[i][0] for i in layer_ids
    ]
    return torch.stack(states, dim=1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual - expected‖ / ‖expected‖."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def token_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Each row's relative error, ‖actual[t] - expected[t]‖ / ‖expected[t]‖ (float64)."""
    difference = actual.double() - expected.double()
    return difference.norm(dim=-1) / expected.double().norm(dim=-1)
