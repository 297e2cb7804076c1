"""Start-up errors about the model, from a real ``hsx serve``: one line, the exit status.

A worker that raises while it builds the model is named by its own exception (vLLM's
parent only says that a background process failed); an architecture hsx cannot extract
from, and a dtype a family cannot run on this platform, are refused before any engine
starts (``startup.check_family``; its lines in full: tests/engine/test_families.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.engine.tiny_models import tiny_config
from tests.e2e.test_startup_errors import assert_one_line, hsx_serve

# hsx serve on model families, up to an engine's start: tens of seconds each.
pytestmark = pytest.mark.slow


def variant(tmp_path: Path, model: Path, **config: Any) -> Path:
    """``model`` with ``config`` over its config.json, its other files linked."""
    out = tmp_path / f"{model.name}-variant"
    out.mkdir()
    for path in model.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path)
    settings = json.loads((model / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**settings, **config}))
    return out


@pytest.mark.engine
@pytest.mark.slow
def test_a_worker_that_cannot_build_the_model_is_named_by_its_error(
    tmp_path: Path, model_dir: Any
) -> None:
    # Qwen3-Next with every layer dense: vLLM's class needs one mixture-of-experts layer
    # and raises while the worker builds the model, after the engine processes started.
    model = variant(tmp_path, model_dir("qwen3-next"), mlp_only_layers=[0, 1, 2, 3])
    env = {
        "HSX_ENGINE__MODEL": str(model),
        "HSX_ENGINE__DTYPE": "bfloat16",
        "HSX_ENGINE__EXTRA_ARGS": '{"enforce_eager": true}',
    }
    run = hsx_serve(tmp_path, env, timeout=300)
    line = assert_one_line(
        run,
        1,
        "hsx: error: the engine failed to start: RuntimeError: No Qwen3Next layer found in "
        "the model.layers. (raised in vLLM's worker)",
        "the debug log has the worker's traceback",
    )
    assert "WorkerProc initialization failed" not in line  # vLLM's wrapper, not the cause
    assert "set_moe_parameters" in run.debug_log  # the worker's traceback is kept there


def test_a_dtype_the_family_cannot_run_on_cpu_is_refused_before_the_engine(
    tmp_path: Path,
) -> None:
    # vLLM would start Qwen3-Next in float32, then fail its first request in the CPU
    # GatedDeltaNet kernel ("CPU GDN attention requires BF16."): /ready would have said 200.
    # The tiny model's config alone: the refusal comes before any weight is read.
    model = tmp_path / "qwen3-next"
    tiny_config("qwen3-next").save_pretrained(model)
    env = {"HSX_ENGINE__MODEL": str(model), "HSX_ENGINE__DTYPE": "float32"}
    run = hsx_serve(tmp_path, env, timeout=300)  # importing vLLM takes a minute on a busy host
    assert_one_line(
        run,
        2,
        "hsx: error: engine.dtype (HSX_ENGINE__DTYPE): Qwen3NextForCausalLM cannot run in "
        "float32 on CPU: vLLM's CPU GatedDeltaNet kernel takes bfloat16 only",
        "; set it to bfloat16",
    )
    assert "EngineCore" not in run.stderr + run.debug_log  # no engine process ever ran
    assert "Application startup" not in run.debug_log  # nor the app that answers /ready


def test_an_architecture_hsx_cannot_extract_from_is_refused_before_the_engine(
    tmp_path: Path,
) -> None:
    # vLLM serves Jamba (Mamba + attention + experts) without EAGLE-3's aux-hidden-state
    # interface, and hsx has no class for it: extract_hidden_states could not read its
    # states. A tiny config alone: the refusal comes before any weight is read.
    from transformers import JambaConfig

    model = tmp_path / "jamba"
    config = JambaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
    )
    config.architectures = ["JambaForCausalLM"]
    config.save_pretrained(model)
    run = hsx_serve(tmp_path, {"HSX_ENGINE__MODEL": str(model)}, timeout=300)
    assert_one_line(
        run,
        2,
        "hsx: error: engine.model (HSX_ENGINE__MODEL): hsx cannot extract hidden states "
        "from JambaForCausalLM",
        "SupportsEagle3",
        "serve a model of a family that works: Llama, Nemotron-H, Qwen3-Next",
        "docs/models.md",
    )
    assert "EngineCore" not in run.stderr + run.debug_log  # no engine process ever ran
    assert "Application startup" not in run.debug_log
