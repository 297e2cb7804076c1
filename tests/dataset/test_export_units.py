"""The export's conversions without a server: the target's final norm against
transformers' own models, the layouts' layer plans and file names, the vocabulary
maps' top-up, and the layer convention's norm side.

The ``1 + weight`` norms (Gemma, Qwen3-Next) are checked here, at the unit level: vLLM
0.32 cannot extract hidden states from a Gemma (``GemmaForCausalLM``,
``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` do not implement its ``SupportsEagle3``
interface: serving hsx's tiny Gemma 3 fails with "Model does not support EAGLE3
interface but aux_hidden_state_outputs was requested"), and its CPU GatedDeltaNet runs
Qwen3-Next in bfloat16 only, too far from a float32 reference for a 1e-5 bound. So a
tiny transformers model of each family is saved as a checkpoint; its last decoder
layer's output (before the norm, as hsx stores it) goes through
``load_final_norm(checkpoint)`` and must equal transformers' own after-norm output; and
on bfloat16 states the norm must equal each family's transformers module bit for bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from service.dataset.export_model import objects_side
from service.dataset.final_norm import NormError, load_final_norm
from service.dataset.layouts import ExportError, make_layout, relative_path
from service.dataset.vocab_map import modelopt_d2t, speculators_maps


def _common() -> dict[str, Any]:
    return {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_common(), num_hidden_layers=2, rms_norm_eps=1e-5))


def _gemma() -> Any:
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(**_common(), num_hidden_layers=2))


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["sliding_attention", "full_attention"]
    config = Gemma3TextConfig(
        **_common(),
        num_hidden_layers=2,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=layer_types,
    )
    return Gemma3ForCausalLM(config)


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **_common(), num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    return Qwen3NextForCausalLM(config)


#: family -> (its tiny model, its transformers norm class, hsx's name of the norm).
FAMILIES: dict[str, tuple[Callable[[], Any], str, str]] = {
    "llama": (_llama, "transformers.models.llama.modeling_llama.LlamaRMSNorm", "rmsnorm"),
    "gemma": (
        _gemma,
        "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
        "rmsnorm_1_plus_weight",
    ),
    "gemma3_text": (
        _gemma3,
        "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm",
        "rmsnorm_1_plus_weight",
    ),
    "qwen3_next": (
        _qwen3_next,
        "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm",
        "rmsnorm_1_plus_weight",
    ),
}


def _norm_class(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_final_norm_from_the_checkpoint_equals_transformers(family: str, tmp_path: Path) -> None:
    make, norm_class, kind = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # Gemma and Qwen3-Next start their weights at 0 (= 1 + 0)
        model.model.norm.weight.normal_(0.0, 0.5)
    # A sharded checkpoint for one family: the norm is found through the index.
    model.save_pretrained(tmp_path, max_shard_size="40KB" if family == "gemma" else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (family == "gemma")
    captured: dict[str, torch.Tensor] = {}

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        captured["before"] = output[0] if isinstance(output, tuple) else output

    model.model.layers[-1].register_forward_hook(keep)
    with torch.no_grad():
        out = model(torch.tensor([[5, 17, 3, 99, 42, 8, 64, 11, 2, 30]]), output_hidden_states=True)
    norm = load_final_norm(tmp_path)
    assert (norm.model_type, norm.kind.name) == (family, kind)
    after = norm(captured["before"][0])
    error = float((after - out.hidden_states[-1][0]).norm() / out.hidden_states[-1][0].norm())
    assert error <= 1e-6, f"{family}: relative error {error:.3g}"
    # bfloat16 states: bit for bit the family's own module (its order of operations).
    reference = _norm_class(norm_class)(64, eps=norm.eps).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(model.model.norm.weight)
        states = torch.randn(7, 64, dtype=torch.bfloat16) * 30
        assert torch.equal(norm(states), reference(states))


def test_a_norm_hsx_does_not_know_is_refused_not_guessed(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(NormError, match=r"does not know the final norm of model_type 'gpt2'"):
        load_final_norm(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "rms_norm_eps": 1e-5}')
    with pytest.raises(NormError, match=r"no final norm weight \(model.norm.weight"):
        load_final_norm(tmp_path)


@pytest.mark.parametrize(
    ("fmt", "variant", "held", "layers", "aux", "last"),
    [
        ("specforge", "eagle3", [2, 15, 27, 30], 30, [2, 15, 27], 30),  # SpecForge [1, 14, 26]
        ("specforge", "eagle3", [1, 2, 4], 4, [2, 2, 1], 4),  # [1, 1, 0] for 4 layers
        ("modelopt", None, [2, 15, 27, 30], 30, [2, 15, 27], 30),
        ("modelopt", None, [1, 2, 4], 4, [1, 2], 4),  # [0, 1]: sorted, deduplicated
        ("specforge", "dflash", [2, 15, 27, 30], 30, [2, 15, 27], None),  # what the run holds
        ("eagle", None, [2, 15, 27, 30], 30, [], 30),
    ],
)
def test_default_layers_are_each_trainers_own(
    fmt: Any, variant: str | None, held: list[int], layers: int, aux: list[int], last: int | None
) -> None:
    layout = make_layout(fmt, variant, held, layers, None)
    assert (list(layout.aux), layout.last) == (aux, last)
    assert layout.trainer_aux == [i - 1 for i in aux]


def test_specforge_groups_2000_samples_a_directory_and_modelopt_names_by_id() -> None:
    layout = make_layout("specforge", "eagle3", [2, 15, 27, 30], 30, None)
    assert relative_path(layout, 1999, "x", False) == "data/rows_0-2000/data_1999.ckpt"
    assert relative_path(layout, 2000, "x", True) == "data/rows_2000-4000/data_2000.ckpt.gz"
    modelopt = make_layout("modelopt", None, [2, 15, 27, 30], 30, None)
    assert relative_path(modelopt, 7, "conv-12", False) == "data/conv-12.pt"
    assert relative_path(modelopt, 7, "../etc/passwd", False) == "data/sample-7.pt"
    with pytest.raises(ExportError, match=r"exactly three"):
        make_layout("specforge", "eagle3", [2, 15, 27, 30], 30, [1, 14])
    with pytest.raises(ExportError, match=r"the eagle layout takes no aux layers"):
        make_layout("eagle", None, [2, 15, 27, 30], 30, [1])


def test_vocab_maps_top_up_as_speculators_does_and_keep_modelopt_order() -> None:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = Counter({9: 3, 4: 5, 7: 3})  # insertion order 9, 4, 7
    d2t, t2d = speculators_maps(freq, 5, 12)
    want_d2t, want_t2d = build_vocab_mappings_from_distribution(dict(freq), 5, 12)
    assert torch.equal(d2t, want_d2t)
    assert torch.equal(t2d, want_t2d)
    # ModelOpt: most_common order (ties first seen first), then the top-up.
    assert (modelopt_d2t(freq, 5) + torch.arange(5)).tolist() == [4, 9, 7, 0, 1]


def test_the_layer_convention_says_the_norm_side() -> None:
    from service.engine.provenance import LAYER_CONVENTION

    assert objects_side(LAYER_CONVENTION, "run") == "before"
    assert objects_side(LAYER_CONVENTION.replace("before", "after"), "run") == "after"
    assert objects_side(None, "run") == "before"  # servers that stated none: hsx's only one
    with pytest.raises(ExportError, match=r"does not say on which side"):
        objects_side("layer ids are vLLM's", "row 3")
