"""The stored object: one safetensors file per prompt.

Tensors ``hidden_states`` [num_tokens, num_layers, hidden_size] (model dtype) and
``token_ids`` int64 [num_tokens], the names and layout of vLLM's example connector, so
existing loaders (speculators) read our files; ``loss_mask`` uint8 [num_tokens] (aligned
with ``token_ids``, unshifted) when the request asked for one. ``__metadata__`` holds
strings only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

FORMAT_VERSION = "1"
# Metadata keys we own; a caller's metadata may not override them.
RESERVED_KEYS = frozenset({"format", "format_version", "model", "layer_ids", "dtype"})


def object_metadata(
    model: str, layer_ids: Sequence[int], dtype: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The ``__metadata__`` of one object: ours first, the caller's strings beside."""
    meta = {k: v for k, v in (extra or {}).items() if k not in RESERVED_KEYS}
    meta.update(
        {
            "format": "hsx.hidden_states",
            "format_version": FORMAT_VERSION,
            "model": model,
            "layer_ids": json.dumps(list(layer_ids)),
            "dtype": dtype,
        }
    )
    return meta


def serialize(
    hidden_states: Any, token_ids: Any, metadata: Mapping[str, str], loss_mask: Any = None
) -> bytes:
    """safetensors bytes of one object (tensors must be on the CPU)."""
    import torch
    from safetensors.torch import save

    tensors = {
        "hidden_states": hidden_states.contiguous(),
        "token_ids": token_ids.to(torch.int64).contiguous(),
    }
    if loss_mask is not None:
        tensors["loss_mask"] = loss_mask.to(torch.uint8).contiguous()
    return bytes(save(tensors, metadata=dict(metadata)))
