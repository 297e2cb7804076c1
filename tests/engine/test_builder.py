"""Engine construction from settings, checked without starting an engine."""

from __future__ import annotations

from typing import Any

import pytest

from service.config import EngineSettings, Settings
from service.engine.builder import (
    default_layer_ids,
    engine_args,
    memory_args,
    read_model_info,
    resolve_layer_ids,
)
from service.engine.parallel import cpu_binding


@pytest.mark.parametrize(
    ("layers", "expected"),
    [(32, [2, 16, 29, 32]), (36, [2, 18, 33, 36]), (4, [1, 2, 4]), (2, [0, 1, 2])],
)
def test_default_layer_ids_follow_eagle3(layers: int, expected: list[int]) -> None:
    assert default_layer_ids(layers) == expected


def test_out_of_range_layer_ids_say_what_the_model_allows() -> None:
    with pytest.raises(ValueError, match=r"\[5, 9\].*4 decoder layers.*0\.\.4"):
        resolve_layer_ids([0, 5, 9], 4)
    assert resolve_layer_ids([4, 0], 4) == [4, 0]


def test_model_info_of_dense_and_hybrid(model_dir: Any) -> None:
    dense = read_model_info(str(model_dir("llama")))
    hybrid = read_model_info(str(model_dir("nemotron-h")))
    assert (dense.num_layers, dense.hidden_size, dense.hybrid) == (4, 128, False)
    assert (hybrid.num_layers, hybrid.hidden_size, hybrid.hybrid) == (4, 128, True)


def test_engine_args_wire_our_connector_and_defaults(model_dir: Any) -> None:
    model = str(model_dir("nemotron-h"))
    settings = Settings(engine={"model": model, "extra_args": {"enforce_eager": True}})
    info = read_model_info(model)
    args = engine_args(settings, info, [1, 2, 4], "ipc:///tmp/x.sock")
    assert args.speculative_config["method"] == "extract_hidden_states"
    hf = args.speculative_config["draft_model_config"]["hf_config"]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    transfer = args.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_connector_module_path) == (
        "HsxConnector",
        "service.engine.connector",
    )
    assert transfer.kv_connector_extra_config["completion_address"] == "ipc:///tmp/x.sock"
    assert args.enable_prefix_caching is False  # hybrid on CPU: no Triton align path
    assert args.enforce_eager is True
    dense = read_model_info(str(model_dir("llama")))
    assert engine_args(settings, dense, [1], "ipc:///x").enable_prefix_caching is True


@pytest.mark.parametrize(
    ("engine", "on_cpu", "expected"),
    [
        # Nothing set on CPU: a fixed 1 GiB cache, so vLLM skips its "90% of node 0
        # free" check that fails on a loaded machine.
        ({}, True, {"kv_cache_memory_bytes": 1024**3}),
        ({"cpu_kvcache_space_gib": 2.5}, True, {"kv_cache_memory_bytes": int(2.5 * 1024**3)}),
        # A utilisation alone: vLLM sizes the cache from it, as the user asked.
        ({"gpu_memory_utilization": 0.4}, True, {"gpu_memory_utilization": 0.4}),
        (
            {"gpu_memory_utilization": 0.4, "cpu_kvcache_space_gib": 1},
            True,
            {"gpu_memory_utilization": 0.4, "kv_cache_memory_bytes": 1024**3},
        ),
        # GPU: vLLM's own defaults; the CPU cache size does not apply.
        ({}, False, {}),
        ({"cpu_kvcache_space_gib": 3}, False, {}),
        ({"gpu_memory_utilization": 0.8}, False, {"gpu_memory_utilization": 0.8}),
    ],
)
def test_memory_defaults_start_on_a_loaded_cpu(
    engine: dict[str, Any], on_cpu: bool, expected: dict[str, Any]
) -> None:
    assert memory_args(EngineSettings(**engine), on_cpu) == expected


def test_extra_args_may_override_memory_settings(model_dir: Any) -> None:
    model = str(model_dir("llama"))
    extra = {"kv_cache_memory_bytes": 123 * 1024**2, "gpu_memory_utilization": 0.3}
    settings = Settings(engine={"model": model, "extra_args": extra})
    args = engine_args(settings, read_model_info(model), [1], "ipc:///x")
    assert (args.kv_cache_memory_bytes, args.gpu_memory_utilization) == (123 * 1024**2, 0.3)


def test_each_rank_gets_its_own_cpus() -> None:
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert cpu_binding(1, [3]) == "3"
    with pytest.raises(ValueError, match="need at least 4 CPUs"):
        cpu_binding(4, [0, 1])


@pytest.mark.parametrize(
    ("given", "refused"),
    [(True, True), ("true", True), (1, True), (False, False), ("false", False), ("0", False)],
)
def test_sleep_mode_never_reaches_vllm(model_dir: Any, given: Any, refused: bool) -> None:
    """hsx's connector holds the cache and pinned buffers sleep would free or remap: it
    answers vLLM 0.33's question with False, and no engine is built asking for it (vLLM
    0.32 would not ask)."""
    from service.engine.connector import HsxConnector

    assert HsxConnector.supports_sleep_mode(None) is False  # type: ignore[arg-type]
    model = str(model_dir("llama"))
    settings = Settings(engine={"model": model, "extra_args": {"enable_sleep_mode": given}})
    info = read_model_info(model)
    if refused:
        with pytest.raises(ValueError, match=r"^engine\.extra_args: enable_sleep_mode is refused"):
            engine_args(settings, info, [1], "ipc:///x")
    else:
        assert engine_args(settings, info, [1], "ipc:///x").enable_sleep_mode == given


class _H200:
    """vLLM's platform as an H200 reports itself: what ``get_batch_defaults`` reads."""

    @staticmethod
    def get_device_total_memory() -> int:
        return 141 << 30

    @staticmethod
    def get_device_name() -> str:
        return "NVIDIA H200"

    @staticmethod
    def is_cpu() -> bool:
        return False

    @staticmethod
    def is_tpu() -> bool:
        return False


def test_the_engine_gets_vllm_serves_batch_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """hsx's engine is built for vLLM's server context, so on an H200 it schedules
    8,192 tokens and 1,024 sequences a step as ``vllm serve`` does; vLLM's default for
    ``from_engine_args`` has no entry and would fall back to 2,048 and 128."""
    from vllm.config import SchedulerConfig
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    from service.engine.builder import usage_context

    def defaults(context: Any) -> tuple[int, int]:
        tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
        return (
            tokens.get(context, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS),
            seqs.get(context, SchedulerConfig.DEFAULT_MAX_NUM_SEQS),
        )

    # On this CPU both contexts give the same steps, so nothing measured here moves.
    assert defaults(usage_context()) == defaults(UsageContext.ENGINE_CONTEXT) == (2048, 128)
    monkeypatch.setattr(arg_utils, "current_platform", _H200())
    assert defaults(usage_context()) == (8192, 1024)
    assert defaults(UsageContext.ENGINE_CONTEXT) == (2048, 128)
