"""Assertions shared by the engine tests: what a user checks in a stored object."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load

from tests.engine.reference import reference_states, relative_error

#: Largest relative error seen per model, reported at the end of the session.
WORST: dict[str, float] = {}


def assert_object_matches(
    data: bytes, model: str, token_ids: list[int], layer_ids: list[int], extraction: Any
) -> None:
    """Stored states equal transformers', per layer, to 1e-5; ids exact; no NaN or zeros."""
    tensors = load(data)
    states, stored_ids = tensors["hidden_states"], tensors["token_ids"]
    assert stored_ids.dtype == torch.int64
    assert stored_ids.tolist() == token_ids
    assert (
        tuple(states.shape) == extraction.shape == (len(token_ids), len(layer_ids), states.shape[2])
    )
    assert extraction.num_tokens == len(token_ids)
    assert torch.isfinite(states).all()
    expected = reference_states(model, token_ids, layer_ids)
    for j, layer in enumerate(layer_ids):
        assert states[:, j].abs().sum() > 0, f"layer {layer} is all zeros"
        error = relative_error(states[:, j], expected[:, j])
        WORST[model] = max(WORST.get(model, 0.0), error)
        assert error <= 1e-5, (
            f"layer {layer}: relative error {error:.2e} over {len(token_ids)} tokens"
        )


def object_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + header_len])["__metadata__"])
