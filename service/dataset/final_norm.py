"""The target model's final norm, read from its directory, for exports whose trainer
wants the last layer *after* it.

hsx stores id ``num_hidden_layers`` before the final norm (``hsx.provenance.
layer_convention``); SpecForge's EAGLE-3 ``hidden_state``, ModelOpt's ``hidden_states``
and EAGLE's ``hidden_state`` are after it (their target head is the bare ``lm_head``).
The norm is the target's own: its kind from ``config.json``'s ``model_type`` (or its
``text_config``'s), its weight the tensor ``model.norm.weight`` of the checkpoint's
safetensors, its epsilon ``rms_norm_eps``. Two families exist, and mixing them up is
silent (ModelOpt #1846, #1965): ``x * rsqrt(mean(x²) + eps) * weight`` (Llama, Qwen,
Mistral...) and ``* (1 + weight)`` (Gemma 1-3, Qwen3-Next). Each is computed in the
order transformers computes it (Llama casts back to the model dtype before the
weight; Gemma multiplies in float32 and casts after), so bfloat16 states round as the
trainer's reference would. A ``model_type`` not in :data:`NORMS` is refused rather than
guessed (a LayerNorm model would be wrong without a sign of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class NormError(Exception):
    """The final norm cannot be read from the model directory (one line, why)."""


@dataclass(frozen=True)
class NormKind:
    """How a family computes its final RMSNorm."""

    #: 1.0 for the ``1 + weight`` families (weights stored as offsets from one).
    offset: float
    #: True: ``(normed_float32 * weight_float32).to(dtype)`` (Gemma, OLMo 2, GPT-OSS);
    #: False: ``weight * normed.to(dtype)`` (Llama).
    weight_in_float32: bool

    @property
    def name(self) -> str:
        return "rmsnorm_1_plus_weight" if self.offset else "rmsnorm"


LLAMA = NormKind(offset=0.0, weight_in_float32=False)
WEIGHT_IN_FLOAT32 = NormKind(offset=0.0, weight_in_float32=True)
ONE_PLUS = NormKind(offset=1.0, weight_in_float32=True)
#: model_type -> its final norm, each read from transformers' modeling code.
NORMS: dict[str, NormKind] = {
    **dict.fromkeys(
        ["llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3"], LLAMA
    ),
    **dict.fromkeys(["qwen3_moe", "phi3", "granite", "deepseek_v3", "smollm3"], LLAMA),
    **dict.fromkeys(["olmo2", "gpt_oss"], WEIGHT_IN_FLOAT32),
    **dict.fromkeys(["gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next"], ONE_PLUS),
}
#: Where checkpoints keep the final norm's weight (text models, then multimodal ones).
WEIGHT_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)


def text_config(model_dir: Path) -> dict[str, Any]:
    """The model's ``config.json`` (its ``text_config`` for a multimodal model, with
    the outer ``model_type`` kept under ``outer_model_type``). NormError if absent."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NormError(f"{path}: cannot read the model's config ({exc})") from None
    inner = config.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" in inner:
        return {**inner, "outer_model_type": config.get("model_type")}
    return dict(config)


@dataclass(frozen=True)
class FinalNorm:
    """The target's final norm: its family, weight and epsilon, and where they came from."""

    model_type: str
    kind: NormKind
    weight: torch.Tensor
    eps: float
    source: str

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` [..., H] (any float dtype) after the norm, in the same dtype."""
        import torch

        dtype = states.dtype
        # The weight as the model holds it (the checkpoint's dtype may differ).
        weight = self.weight.to(dtype)
        x = states.to(torch.float32)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind.weight_in_float32:
            return (normed * (self.kind.offset + weight.float())).to(dtype)
        return weight * normed.to(dtype)

    def describe(self) -> dict[str, Any]:
        """The manifest's record of this norm."""
        return {
            "model_type": self.model_type,
            "kind": self.kind.name,
            "eps": self.eps,
            "weight_in_float32": self.kind.weight_in_float32,
            "source": self.source,
        }


def load_final_norm(model_dir: Path) -> FinalNorm:
    """The final norm of the model in ``model_dir`` (see the module docstring).

    Raises NormError, one line: no config, an unknown ``model_type``, no ``rms_norm_eps``,
    or no norm weight in its safetensors.
    """
    config = text_config(model_dir)
    model_type = str(config.get("model_type") or "")
    kind = NORMS.get(model_type)
    if kind is None:
        known = ", ".join(sorted(NORMS))
        raise NormError(
            f"{model_dir}: hsx does not know the final norm of model_type {model_type!r} "
            f"(known: {known}); export a layout that keeps the last layer before the norm"
        )
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, int | float):
        raise NormError(f"{model_dir}/config.json: no rms_norm_eps for the final norm")
    key, weight = _norm_weight(model_dir)
    return FinalNorm(model_type, kind, weight, float(eps), f"{model_dir} ({key})")


def _norm_weight(model_dir: Path) -> tuple[str, torch.Tensor]:
    """The first of :data:`WEIGHT_KEYS` found in the directory's safetensors files."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [model_dir / weight_map[k] for k in WEIGHT_KEYS if k in weight_map]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names = set(handle.keys())
            for key in WEIGHT_KEYS:
                if key in names:
                    return key, handle.get_tensor(key)
    tried = ", ".join(WEIGHT_KEYS)
    raise NormError(f"{model_dir}: no final norm weight ({tried}) in its safetensors files")
