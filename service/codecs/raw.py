"""The ``raw`` codec: the states as the model computed them, what every codec decodes to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from service.codecs.registry import CodecImpl, Shape, TensorCheck, register, states_nbytes
from service.codecs.safetensors_io import ST_NAME

if TYPE_CHECKING:
    import torch


@register
class RawCodec(CodecImpl):
    """``raw``: ``hidden_states`` [T, L, H] in the model dtype, vLLM's example-connector
    layout."""

    name = "raw"
    summary = "model dtype"
    needs_dtype = False

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden_states": states}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return states_nbytes(shape, dtype)

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        wanted = [ST_NAME[dtype]] if dtype else ["F32", "BF16", "F16"]
        return list(tensor("hidden_states", wanted, 3))

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return tensors["hidden_states"]
