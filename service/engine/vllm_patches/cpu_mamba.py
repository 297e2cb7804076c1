"""A correct CPU ``causal_conv1d_update`` for Mamba layers under speculative decoding.

Why this exists: ``extract_hidden_states`` is a speculative method with one speculative
token, so vLLM 0.32 gives every Mamba conv state ``width - 1 + 1`` columns and calls
``causal_conv1d_update`` with ``num_accepted_tokens`` for two kinds of rows: decode steps
(the sampled token plus one draft) and the one-token last chunk of a chunked prefill.
The CUDA (Triton) kernel reads the history window at column ``num_accepted_tokens - 1``
and rolls the window by the tokens it processed. vLLM's CPU replacement ignores
``num_accepted_tokens`` and reads the last ``width - 1`` columns, one column past the
history the prefill wrote. The result is a wrong state for every such row: a prompt whose
last prefill chunk is a single token came back with 0.55 relative error on that token,
and decoded tokens diverged from transformers.

``install()`` swaps the function that ``mamba_mixer2`` calls, in the worker process
only, for one that follows the Triton kernel's semantics on the speculative path and
delegates every other call to vLLM's own CPU function. A correctness patch: where the
CPU function, the Triton kernel's parameters or the call that hands them over are not
what this was checked against, ``hsx serve`` stops at start-up naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from service.engine.vllm_patches.fingerprints import Calls, Digest, Params
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint, applies

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_CPU_KERNEL = "vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d"
_TRITON_PARAMS = (
    "x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, "
    "query_start_loc, max_query_len, null_block_id"
)
PATCH = TouchPoint(
    name="cpu-mamba-conv-update",
    kind=Kind.CORRECTNESS,
    hsx="service/engine/vllm_patches/cpu_mamba.py",
    target="replaces vllm.model_executor.layers.mamba.mamba_mixer2.causal_conv1d_update "
    "(vLLM's CPU causal_conv1d_update_cpu) on the speculative path",
    why="vLLM's CPU conv update ignores num_accepted_tokens and reads the history one "
    "column late: wrong Mamba states (0.55 relative error) under extract_hidden_states",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Digest(
            f"{_CPU_KERNEL}:causal_conv1d_update_cpu",
            {"0.32.0": "cf2d8caa009a212d", "0.33.0": "cf2d8caa009a212d"},
        ),
        Params(
            "vllm.model_executor.layers.mamba.ops.causal_conv1d:causal_conv1d_update",
            {
                "0.32.0": _TRITON_PARAMS + ", block_idx_last_scheduled_token, "
                "initial_state_idx, validate_data, out",
                "0.33.0": _TRITON_PARAMS + ", validate_data, out",
            },
        ),
        Calls(
            "vllm.model_executor.layers.mamba.mamba_mixer2:causal_conv1d_update",
            dict.fromkeys(
                ("0.32.0", "0.33.0"),
                "MambaMixer2.conv_ssm_forward: 5 +conv_state_indices +max_query_len "
                "+num_accepted_tokens +query_start_loc",
            ),
        ),
    ),
    notes={
        "0.33.0": "the Triton kernel dropped its prefix-caching inputs "
        "(block_idx_last_scheduled_token, initial_state_idx); its speculative path, which "
        "this follows, is unchanged, and the call and the CPU function are the same"
    },
)


def causal_conv1d_update_spec(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: bool | str | None,
    *,
    conv_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    null_block_id: int,
) -> torch.Tensor:
    """Varlen conv update with a rolling window, as vLLM's Triton kernel does it.

    ``x`` is ``[num_tokens, dim]``; ``conv_state`` is ``(cache_lines, dim, state_len)``
    (possibly a transposed view); ``conv_state_indices`` is ``(batch, >=1)`` or
    ``(batch,)``. For a row with ``n`` tokens and ``a`` accepted tokens the history is
    ``state[:, a-1 : a-1 + width-1]``; afterwards columns ``[0, width-2+n)`` hold
    ``history[1:] + x``, so the next step finds its window at ``accepted - 1``.
    """
    import torch
    import torch.nn.functional as F

    silu = activation is True or activation in ("silu", "swish")
    width = weight.shape[1]
    original_dtype = x.dtype
    x = x.to(conv_state.dtype)
    out = torch.empty_like(x)
    indices = conv_state_indices if conv_state_indices.dim() == 2 else conv_state_indices[:, None]
    starts = query_start_loc.tolist()
    lines = indices[:, 0].tolist()
    accepted = num_accepted_tokens.tolist()
    kernel = weight.unsqueeze(1)
    for row, line in enumerate(lines):
        begin, end = starts[row], starts[row + 1]
        if begin == end or line == null_block_id:
            continue
        state = conv_state[line]
        offset = int(accepted[row]) - 1
        tokens = x[begin:end].transpose(0, 1)  # (dim, n)
        history = state[:, offset : offset + width - 1]
        window = torch.cat([history, tokens], dim=-1)
        y = F.conv1d(window.unsqueeze(0).to(weight.dtype), kernel, bias, groups=weight.shape[0])
        rolled = torch.cat([history[:, 1:], tokens], dim=-1)  # cat copies: no aliasing
        state[:, : rolled.shape[1]].copy_(rolled)
        y = y[0].to(x.dtype)
        out[begin:end] = (F.silu(y) if silu else y).transpose(0, 1)
    return out.to(original_dtype)


def _patched(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def causal_conv1d_update(
        x: torch.Tensor, conv_state: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        names = ("weight", "bias", "activation")
        params = dict(zip(names, args, strict=False)) | kwargs
        accepted = params.get("num_accepted_tokens")
        if accepted is None or params.get("block_idx_last_scheduled_token") is not None:
            return original(x, conv_state, *args, **kwargs)
        from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

        return causal_conv1d_update_spec(
            x,
            conv_state,
            params["weight"],
            params.get("bias"),
            params.get("activation"),
            conv_state_indices=params["conv_state_indices"],
            num_accepted_tokens=accepted,
            query_start_loc=params["query_start_loc"],
            null_block_id=params.get("null_block_id", NULL_BLOCK_ID),
        )

    causal_conv1d_update.__wrapped__ = original  # type: ignore[attr-defined]
    return causal_conv1d_update


def install() -> bool:
    """Route vLLM's CPU Mamba2 conv update through ours where ``PATCH`` applies (a CPU
    host); idempotent. True if installed. Raises ``PatchTargetChanged`` where its target
    is not what it was checked against."""
    if not applies(PATCH):
        return False
    from vllm.model_executor.layers.mamba import mamba_mixer2

    if not hasattr(mamba_mixer2.causal_conv1d_update, "__wrapped__"):
        mamba_mixer2.causal_conv1d_update = _patched(mamba_mixer2.causal_conv1d_update)
    log.info("hsx: CPU Mamba2 conv update replaced (speculative rows follow the CUDA kernel)")
    return True
