"""The stored object: one safetensors file per prompt.

Tensors ``hidden_states`` [num_tokens, num_layers, hidden_size] (model dtype) and
``token_ids`` int64 [num_tokens], the names and layout of vLLM's example connector, so
existing loaders (speculators) read our files; ``loss_mask`` uint8 [num_tokens] (aligned
with ``token_ids``, unshifted) when the request asked for one. ``__metadata__`` holds
strings only.

Under a token selection (``tokens`` other than ``all``) ``token_ids`` and ``loss_mask``
still cover every stored token, so a reader can align the int64 ``positions`` tensor
(the positions kept, or those a mean averaged over) with them; ``hidden_states`` holds
one row per position, or one row for a mean, and ``hsx.tokens`` records the selection.

Other codecs (``service.codecs``) change how the states are stored; ``hsx.codec`` in
the metadata says which one, and ``service.codecs.decode`` reads any.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from service import codecs
from service.codecs import CODEC_KEY, CODEC_VERSION_KEY, DECODED_FROM_KEY, TOKENS_KEY, Codec
from service.engine.builder import served_model_name
from service.engine.provenance import METADATA_PREFIX

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = "1"
# Metadata keys we own; a caller's metadata may not override them.
RESERVED_KEYS = frozenset(
    {
        "format",
        "format_version",
        "model",
        "layer_ids",
        "dtype",
        CODEC_KEY,
        CODEC_VERSION_KEY,
        DECODED_FROM_KEY,
        TOKENS_KEY,
    }
)
#: Key prefixes we own (every ``hsx.provenance.*`` key, known or not on this server).
RESERVED_PREFIXES = (METADATA_PREFIX,)


def is_reserved(key: str) -> bool:
    """Whether a metadata key is ours: a caller may not set it."""
    return key in RESERVED_KEYS or key.startswith(RESERVED_PREFIXES)


def reserved_keys(keys: Iterable[str]) -> list[str]:
    """The reserved ones among ``keys``, sorted (what a refusal names)."""
    return sorted(k for k in keys if is_reserved(k))


def object_metadata(
    model: str,
    layer_ids: Sequence[int],
    dtype: str,
    extra: Mapping[str, str] | None = None,
    provenance: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``__metadata__`` of one object: ours, the server's ``provenance``
    (``Provenance.metadata``) and the caller's strings (``extra``) beside them. The one
    place they meet: a caller's reserved key never overrides ours.

    ``model`` is the served model as the engine was given it, a hub id or a local
    path; the object records its served name (``builder.served_model_name``, what
    ``/v1/models`` answers), never the path: every reader of an object would otherwise
    learn the server's file system layout (issue 58, L3).
    """
    meta = {k: v for k, v in (extra or {}).items() if not is_reserved(k)}
    meta.update({k: v for k, v in (provenance or {}).items() if k.startswith(METADATA_PREFIX)})
    meta.update(
        {
            "format": "hsx.hidden_states",
            "format_version": FORMAT_VERSION,
            "model": served_model_name(model),
            "layer_ids": json.dumps(list(layer_ids)),
            "dtype": dtype,
        }
    )
    return meta


def serialize_parts(
    codec: Codec,
    hidden_states: Any,
    token_ids: Any,
    metadata: Mapping[str, str],
    prepared: Mapping[str, Any] | None = None,
    loss_mask: Any = None,
    positions: Any = None,
) -> list[bytes | memoryview]:
    """One object's safetensors bytes as [header, tensor memory...], no tensor copied
    (``service.codecs.pack_parts``); what the writer hands to storage. Tensors must be
    on the CPU.

    ``prepared``: the codec's first stage already ran on the device (CUDA), these are
    its tensors; otherwise it runs here, on ``hidden_states``. ``positions``: the
    selected token positions (int64), for an object under a token selection.
    """
    import torch

    tensors = prepared if prepared is not None else codecs.prepare(codec, hidden_states)
    extra = {} if loss_mask is None else {"loss_mask": loss_mask.to(torch.uint8)}
    if positions is not None:
        extra["positions"] = positions.to(torch.int64)
    return codecs.pack_parts(codec, tensors, token_ids, metadata, extra)


def loss_mask(spans: Sequence[tuple[int, int]], num_tokens: int) -> torch.Tensor:
    """uint8 [num_tokens]: 1 on the supervised ``[start, end)`` ranges."""
    import torch

    mask = torch.zeros(num_tokens, dtype=torch.uint8)
    for start, end in spans:
        mask[start:end] = 1
    return mask
