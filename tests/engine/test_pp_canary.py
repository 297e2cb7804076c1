"""Canary: vLLM itself still refuses pipeline parallelism with ``extract_hidden_states``.

hsx refuses ``pipeline_parallel_size`` above 1 at start-up (``service.startup``) because
vLLM does. When this test fails, vLLM accepts PP with extract_hidden_states, and hsx can
consider supporting it (see docs/design.md, "Pipeline parallelism", for what hsx's
connector would need).

vLLM's own config is built from the engine arguments hsx builds
(``service.engine.builder.engine_args``), with only ``pipeline_parallel_size`` changed:
no engine starts and no process is spawned (a second or two after vLLM's import).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from unittest import mock

import pytest

from service.config import Settings
from service.engine.builder import engine_args, read_model_info


def hsx_engine_args(model_dir: Any) -> Any:
    """``AsyncEngineArgs`` as hsx builds them for the tiny Llama (one pipeline stage:
    hsx's builder refuses more)."""
    model = str(model_dir("llama"))
    settings = Settings(engine={"model": model, "dtype": "float32"})
    return engine_args(settings, read_model_info(model), [1, 2, 4], "ipc:///nowhere.sock")


def test_vllm_refuses_pipeline_parallel_extract_hidden_states(model_dir: Any) -> None:
    """When this test fails, vLLM accepts PP with extract_hidden_states, and hsx can
    consider supporting it (see docs/design.md)."""
    args = hsx_engine_args(model_dir)
    assert args.speculative_config["method"] == "extract_hidden_states"
    assert args.pipeline_parallel_size == 1  # hsx passes vLLM's default unchanged
    # vLLM's config sets process-wide variables (LD_PRELOAD, the worker start method):
    # keep them out of the tests that follow in this process.
    with mock.patch.dict(os.environ):
        try:
            dataclasses.replace(args, pipeline_parallel_size=2).create_engine_config()
        except Exception as exc:
            refusal = exc
        else:
            pytest.fail(
                "vLLM now accepts pipeline_parallel_size=2 with extract_hidden_states: hsx "
                "can consider supporting it (docs/design.md, 'Pipeline parallelism'), then "
                "lift the refusal in service/startup.py and turn this canary around"
            )
        # The model is not the reason: Llama implements SupportsPP, and the same
        # arguments without extract_hidden_states give a two-stage config.
        plain = dataclasses.replace(args, speculative_config=None, pipeline_parallel_size=2)
        assert plain.create_engine_config().parallel_config.pipeline_parallel_size == 2
    message = str(refusal)
    # vLLM 0.32: NotImplementedError from the draft (ExtractHiddenStatesModel) config's
    # verify_with_parallel_config, the words hsx's users met before hsx refused PP itself.
    assert "Pipeline parallelism is not supported for this model" in message, message
    assert "SupportsPP" in message, message


@pytest.mark.parametrize(
    ("engine", "setting"),
    [
        ({"pipeline_parallel_size": 2}, "engine.pipeline_parallel_size"),
        ({"extra_args": {"pipeline_parallel_size": 2}}, "engine.extra_args"),
        ({"extra_args": {"pipeline_parallel_size": "2"}}, "engine.extra_args"),
    ],
)
def test_hsx_builder_refuses_pipeline_parallel(
    model_dir: Any, engine: dict[str, Any], setting: str
) -> None:
    # The in-process path (tests, benchmarks: Extractor.start) refuses as `hsx serve`
    # does, before the storage opens, so nothing reaches vLLM with two stages.
    from service.engine.builder import prepare

    model = str(model_dir("llama"))
    settings = Settings(engine={"model": model, **engine})
    info = read_model_info(model)
    expected = rf"^{setting}: pipeline_parallel_size .* is refused: .*SupportsPP.*data parallelism"
    with pytest.raises(ValueError, match=expected):
        engine_args(settings, info, [1], "ipc:///nowhere.sock")
    with pytest.raises(ValueError, match=expected):
        prepare(settings)
    # One stage, however given, leaves vLLM's arguments as they were.
    for one in ({}, {"pipeline_parallel_size": 1}, {"extra_args": {"pipeline_parallel_size": 1}}):
        args = engine_args(Settings(engine={"model": model, **one}), info, [1], "ipc:///x.sock")
        assert args.pipeline_parallel_size == 1
