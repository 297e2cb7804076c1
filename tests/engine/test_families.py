"""What hsx knows of model families before an engine starts (service/engine/families.py)
and the classes it registers for them (service/engine/models.py)."""

from __future__ import annotations

import importlib

import pytest

from service.engine.builder import ModelInfo
from service.engine.families import WRAPPED, dtype_refusal, extraction_refusal, served_dtype


def qwen3_next(config_dtype: str | None) -> ModelInfo:
    return ModelInfo(
        "q",
        4,
        256,
        True,
        architecture="Qwen3NextForCausalLM",
        model_type="qwen3_next",
        config_dtype=config_dtype,
    )


@pytest.mark.parametrize(
    ("setting", "config", "served"),
    [
        ("auto", "float32", "bfloat16"),  # vLLM takes float32 configs down on CPU
        ("auto", None, "bfloat16"),
        ("auto", "float16", "float16"),
        ("auto", "bfloat16", "bfloat16"),
        ("float32", "bfloat16", "float32"),
    ],
)
def test_auto_serves_what_vllm_would(setting: str, config: str | None, served: str) -> None:
    assert served_dtype(setting, config, preferred="bfloat16") == served


def test_qwen3_next_runs_in_bfloat16_only_on_cpu() -> None:
    assert dtype_refusal(qwen3_next("float32"), "auto", True, "bfloat16") is None
    assert dtype_refusal(qwen3_next("float32"), "float32", False, "bfloat16") is None  # GPU
    refusal = dtype_refusal(qwen3_next("float16"), "auto", True, "bfloat16")
    assert refusal is not None
    assert refusal.setting == "engine.dtype"
    assert refusal.problem.startswith(
        "Qwen3NextForCausalLM cannot run in 'auto', which serves this model in float16, on CPU"
    )
    assert refusal.fix == "set it to bfloat16"


def test_each_wrapped_class_is_vllms_with_the_eagle3_interface() -> None:
    from vllm.model_executor.models.interfaces import supports_eagle3

    models = importlib.import_module("service.engine.models")
    for architecture, name in WRAPPED.items():
        ours = getattr(models, name)
        # vLLM's class of that name, which hsx's derives from and registers in its place.
        (theirs,) = [c for c in ours.__mro__[1:] if c.__name__ == architecture]
        assert theirs.__module__.startswith("vllm.model_executor.models.")
        assert not supports_eagle3(theirs)
        assert supports_eagle3(ours)


def test_an_architecture_hsx_cannot_extract_from_is_refused_in_one_line() -> None:
    """hsx serve's check before the engine (service.startup.check_family), its line in
    full; tests/e2e/test_model_startup_errors.py runs it in a real hsx serve on Jamba."""
    from service.config import EngineSettings
    from service.startup import StartupError, check_family

    assert extraction_refusal("FalconH1ForCausalLM") is None  # hsx's wrapper
    assert extraction_refusal("LlamaForCausalLM") is None  # vLLM's own interface
    assert extraction_refusal("NoSuchModelForCausalLM") is None  # left to vLLM
    # vLLM serves GraniteMoeHybrid, without EAGLE-3's interface; hsx does not wrap it.
    granite = ModelInfo("g", 2, 64, True, architecture="GraniteMoeHybridForCausalLM")
    with pytest.raises(StartupError) as refused:
        check_family(EngineSettings(), granite)
    assert refused.value.exit_code == 2
    assert refused.value.line == (
        "hsx: error: engine.model (HSX_ENGINE__MODEL): hsx cannot extract hidden states "
        "from GraniteMoeHybridForCausalLM: vLLM's class has no EAGLE-3 aux-hidden-state "
        "interface (SupportsEagle3), which extract_hidden_states reads them through, and "
        "hsx has no wrapper for it; serve a model of a family that works: Llama, "
        "Nemotron-H, Qwen3-Next (bfloat16 on CPU), Falcon-H1 and Gemma 3 were run; any "
        "architecture whose vLLM class implements SupportsEagle3, or one of hsx's wrapped "
        "ones (FalconH1ForCausalLM, Gemma3ForCausalLM) (docs/models.md)"
    )
