"""Encoding an object, in two stages so a GPU can do the first before the device-to-host
copy: ``prepare`` (a tensor transform; runs on any device) and ``pack_parts`` (CPU: byte
planes, zstd, safetensors)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from service.codecs.registry import CODEC_KEY, CODEC_VERSION, CODEC_VERSION_KEY, codec_impl
from service.codecs.safetensors_io import safetensors_parts

if TYPE_CHECKING:
    import torch

    from service.codecs.registry import Codec, Shape


def check_layers(layers: Sequence[int] | None, served: Sequence[int]) -> None:
    """ValueError unless ``layers`` is None or a non-empty subset of ``served`` in that
    order (objects keep the server's layer order)."""
    if layers is None:
        return
    wanted, order = list(layers), list(served)
    if not wanted or wanted != [i for i in order if i in wanted]:
        raise ValueError(
            f"{wanted} is not a non-empty subset of the served layer ids {order} in that order"
        )


def prepare(codec: Codec, states: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stage one: the tensors to copy to the host. Runs on the states' device.

    ``fp8`` and ``bf16`` shrink here, so on a GPU the device-to-host copy shrinks too;
    ``raw`` and ``lossless`` pass the states through (zstd runs on the CPU).
    """
    return codec_impl(codec).prepare(states)


def prepared_nbytes(codec: Codec, shape: Shape, dtype: torch.dtype) -> int:
    """Host bytes of ``prepare``'s tensors for states of ``shape`` and ``dtype``."""
    return codec_impl(codec).prepared_nbytes(shape, dtype)


def restore(codec: Codec, prepared: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The states ``prepare``'s tensors stand for (float32 for fp8; lossless: as is)."""
    return codec_impl(codec).restore(prepared)


def pack_parts(
    codec: Codec,
    prepared: Mapping[str, torch.Tensor],
    token_ids: torch.Tensor,
    metadata: Mapping[str, str],
    extra: Mapping[str, torch.Tensor] | None = None,
) -> list[bytes | memoryview]:
    """Stage two, on the CPU: the object's safetensors bytes in pieces, without copying
    the tensors: the safetensors header, then each tensor's own memory (the pieces keep
    the tensors alive).

    ``metadata`` must name the model ``dtype`` the states decode to; ``hsx.codec`` and
    ``hsx.codec_version`` are set here. ``extra`` tensors (e.g. ``loss_mask``) are
    stored as they are. The writer hands the pieces to storage as they are, so an
    object's states are read once, by the write, instead of being copied into one
    buffer first.
    """
    import torch

    if "dtype" not in metadata:
        raise ValueError("metadata must name the states' dtype")
    tensors = codec_impl(codec).to_tensors(prepared)
    tensors["token_ids"] = token_ids.to(torch.int64).contiguous()
    tensors.update({name: t.contiguous() for name, t in (extra or {}).items()})
    meta = {**metadata, CODEC_KEY: codec, CODEC_VERSION_KEY: CODEC_VERSION}
    return safetensors_parts(tensors, meta)
