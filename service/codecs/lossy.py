"""The lossy codecs, which shrink the states on their device before the copy to the host:
``fp8`` (float8 plus a scale per row) and ``bf16`` (a downcast of float32 states)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from service.codecs.registry import CodecImpl, Shape, TensorCheck, register
from service.codecs.safetensors_io import corrupt

if TYPE_CHECKING:
    import torch

SCALES = "hidden_states_scales"
#: Candidate scales per (token, layer) for fp8: amax / 448 times 2^(k/4). Values near the
#: top of a binade lose least to float8's 3 mantissa bits; trying a few shifts and
#: keeping the best keeps the relative error of every row under 3% (one scale: ~3.3%
#: on the worst rows of 128-wide Gaussian states).
FP8_SCALE_STEPS = 4


@register
class Fp8Codec(CodecImpl):
    """``fp8``: ``hidden_states`` float8_e4m3fn and ``hidden_states_scales`` float32
    [T, L, 1], one scale per (token, layer), so ``states = hidden_states.float() *
    scales``.

    This is hs-connectors' layout (``fp8_utils.py``), so its ``FP8Transfer`` and the
    trainers behind it read these objects unchanged. Values are clamped to float8's
    range before the cast (float8_e4m3fn has no infinity: an overflow is NaN on CUDA).
    It shrinks on the device, so on a GPU the device-to-host copy shrinks too.
    """

    name = "fp8"
    summary = "float8 plus per-row scales, hs-connectors' layout"
    tensor_names = frozenset({"hidden_states", SCALES})

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        quantized, scales = quantize_fp8(states)
        return {"hidden_states": quantized, SCALES: scales}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        tokens, layers, hidden = shape
        return tokens * layers * (hidden + 4)  # one byte per value, a float32 per row

    def restore(self, prepared: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return prepared["hidden_states"].float() * prepared[SCALES]  # float32

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        shape = list(tensor("hidden_states", ["F8_E4M3"], 3))
        if tensor(SCALES, ["F32"], 3) != (*shape[:2], 1):
            raise corrupt(f"{SCALES} must be [T, L, 1] for states {shape}")
        return shape

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return (tensors["hidden_states"].float() * tensors[SCALES]).to(dtype)


@register
class Bf16Codec(CodecImpl):
    """``bf16``: ``hidden_states`` cast to bfloat16, a downcast offered for models
    served in float32 only. It shrinks on the device, as ``fp8`` does."""

    name = "bf16"
    summary = "float32 models only"

    def offered_for(self, model_dtype: str) -> bool:
        return model_dtype == "float32"

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        return {"hidden_states": states.to(torch.bfloat16)}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        tokens, layers, hidden = shape
        return tokens * layers * hidden * 2

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        return list(tensor("hidden_states", ["BF16"], 3))

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return tensors["hidden_states"].to(dtype)


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and float32 scales [T, L, 1]: ``values * scales ~ states``.

    Scales are exact in bfloat16 too, so readers that multiply in bfloat16
    (``FP8Transfer``'s default) lose nothing on them.
    """
    import torch

    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    x = states.float()
    ladder = torch.tensor([2.0 ** (k / FP8_SCALE_STEPS) for k in range(FP8_SCALE_STEPS)])
    base = x.abs().amax(dim=-1, keepdim=True) / top
    # [T, L, steps]; the floor keeps all-zero rows finite.
    scales = (base * ladder.to(x.device)).to(torch.bfloat16).float()
    scales = scales.clamp(min=torch.finfo(torch.bfloat16).tiny)
    errors = []
    for step in range(FP8_SCALE_STEPS):
        scale = scales[..., step : step + 1]
        scaled = x / scale
        lost = scaled.clamp(-top, top).to(fp8).float() - scaled
        # In units of the first scale: scale**2 itself overflows float32 for huge rows.
        errors.append(
            torch.linalg.vector_norm(lost, dim=-1, keepdim=True) * (scale / scales[..., :1])
        )
    best = scales.gather(-1, torch.cat(errors, dim=-1).argmin(dim=-1, keepdim=True))
    return (x / best).clamp(-top, top).to(fp8), best
