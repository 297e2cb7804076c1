"""Assertions shared by the engine tests: what a user checks in a stored object."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load

from tests.engine.reference import reference_states, relative_error, token_errors

#: Largest relative error seen per model, reported at the end of the session.
WORST: dict[str, float] = {}
#: A token this far (relative) from float32 took another path through the model: under
#: bfloat16 a router whose 2nd and 3rd experts score within rounding of each other picks
#: either (0.3-0.6 on that token's state, and some of it reaches later tokens).
OFF_PATH = 0.05


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


def bf16_errors(
    model: str, sequences: list[list[int]], stored: list[torch.Tensor], layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token relative errors against transformers' float32 states of ``sequences``:
    of ``stored`` (bfloat16 states, one per sequence) and of transformers' own bfloat16
    states, each [all tokens, layers]. Asserts that id 0, the embeddings, equals
    transformers' bfloat16 embeddings exactly."""
    ours, theirs = [], []
    for sequence, states in zip(sequences, stored, strict=True):
        float32 = reference_states(model, sequence, layer_ids)
        bfloat16 = reference_states(model, sequence, layer_ids, torch.bfloat16)
        if 0 in layer_ids:
            j = layer_ids.index(0)
            assert torch.equal(states[:, j], bfloat16[:, j].to(states.dtype))
        ours.append(
            torch.stack(
                [token_errors(states[:, j], float32[:, j]) for j in range(len(layer_ids))], 1
            )
        )
        theirs.append(
            torch.stack(
                [token_errors(bfloat16[:, j], float32[:, j]) for j in range(len(layer_ids))], 1
            )
        )
    return torch.cat(ours), torch.cat(theirs)


def assert_within_bf16_gap(
    ours: torch.Tensor, theirs: torch.Tensor, layer_ids: list[int], *, medians: bool = True
) -> None:
    """hsx's bfloat16 states are as close to transformers' float32 states as
    transformers' own bfloat16 states are, layer by layer (``bf16_errors``' errors of
    the same tokens: the bound is computed on them).

    ``medians``: hsx's median per-token error is at most transformers' 75th percentile;
    always: tokens off the float32 path (``OFF_PATH``) are at most twice transformers'
    own count, plus 2. Not norms over all tokens: in a mixture of experts the tokens
    whose expert choice is a tie within bfloat16 rounding dominate a norm, and fall at
    random in either run. Qwen3-Next, 3 runs of 2,587 tokens, ids 1-4: hsx's norm was
    the lower in 9 of 12, its median in 12 of 12 (by 8-12 %); its median was 0.59-0.87
    of transformers' 75th percentile. Over a few hundred tokens the last id's median
    (after the full-attention layer, where a token sent to other experts reaches every
    later token) came out 0.9-1.2 of transformers' median: hence the 75th percentile.
    """
    for j, layer in enumerate(layer_ids):
        mine, their = ours[:, j], theirs[:, j]
        if medians:
            bound = float(their.quantile(0.75))
            assert float(mine.median()) <= bound, (
                f"layer {layer}: median {mine.median():.3e} > {bound:.3e}"
            )
        off, their_off = int((mine > OFF_PATH).sum()), int((their > OFF_PATH).sum())
        assert off <= 2 * their_off + 2, f"layer {layer}: {off} tokens off the path, vs {their_off}"
