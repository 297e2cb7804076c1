"""Tensor parallelism on this CPU: two ranks, the states of rank 0's writer exact.

vLLM's CPU build binds one rank per NUMA node by default and refuses more ranks than
nodes; hsx gives each rank its own CPUs instead (``VLLM_CPU_OMP_THREADS_BIND``,
``service.engine.builder.bind_cpu_workers``), so TP=2 starts on one socket. The KV
cache is sized per rank; the hidden-state layer is replicated on each.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from service.engine.introspect import capacity_of
from service.engine.parallel import cpu_binding
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings, random_prompts, running

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
LAYERS = [0, 1, 2, 4]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp2(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("tp2-objects")
    settings = engine_settings(
        model_dir("llama"),
        str(root),
        engine={"layer_ids": LAYERS, "tensor_parallel_size": 2, "cpu_kvcache_space_gib": 0.01},
    )
    bound = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        async with running(settings) as extractor:
            extractor.test_root = root
            yield extractor
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if bound is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bound


async def read(extractor: Any, key: str) -> bytes:
    return Path(extractor.test_root, key).read_bytes()


def test_each_rank_gets_its_own_cpus() -> None:
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert cpu_binding(1, [3]) == "3"
    with pytest.raises(ValueError, match="need at least 4 CPUs"):
        cpu_binding(4, [0, 1])


async def test_two_ranks_write_states_equal_transformers(tp2: Any) -> None:
    workers = await tp2.on_workers("hsx_memory")
    assert sorted(w["rank"] for w in workers) == [0, 1]  # two ranks, told apart
    prompts = random_prompts([1, 17, 64, 129, 300], seed=21)
    results = await asyncio.gather(*(tp2.extract(p, tp2.request_params("tp")) for p in prompts))
    assert len({r.key for r in results}) == len(prompts)  # one object per prompt
    for prompt, result in zip(prompts, results, strict=True):
        data = await read(tp2, result.key)
        assert_object_matches(data, tp2.settings.engine.model, prompt, LAYERS, result)


async def test_include_output_tokens_is_exact_under_tp(tp2: Any) -> None:
    prompt = random_prompts([40], seed=22)[0]
    params = tp2.request_params("tp", include_output_tokens=True)
    result = await tp2.extract(prompt, params, max_tokens=5)
    sequence = prompt + list(result.output_token_ids[:-1])
    data = await read(tp2, result.key)
    assert_object_matches(data, tp2.settings.engine.model, sequence, LAYERS, result)


async def test_a_flood_through_a_small_cache_leaves_it_empty(tp2: Any) -> None:
    """Many more tokens than the cache holds, all answered; then a prompt that needs the
    whole cache is: no block was left held."""
    capacity = capacity_of((await tp2.on_workers("hsx_kv_layout"))[0])["tokens"]
    longest = tp2.max_model_len - 1
    assert capacity >= longest  # the setting holds one full sequence per rank
    lengths = [(97 * i) % (longest - 10) + 10 for i in range(110)]
    assert sum(lengths) > 3 * capacity
    prompts = random_prompts(lengths, seed=23)
    results = await asyncio.gather(*(tp2.extract(p, tp2.request_params("flood")) for p in prompts))
    assert [r.num_tokens for r in results] == lengths
    assert len(list(Path(tp2.test_root, "hsx", "flood").rglob("*.safetensors"))) == len(prompts)
    assert not tp2.engine.output_processor.has_unfinished_requests()
    whole = await tp2.extract(random_prompts([longest], seed=24)[0], tp2.request_params("flood"))
    assert whole.num_tokens == longest
