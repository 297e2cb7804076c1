"""Tensor and data parallelism on this CPU: two ranks, or two engines, states exact.

vLLM's CPU build binds one rank per NUMA node by default and refuses more ranks than
nodes; hsx gives each rank its own CPUs instead (``VLLM_CPU_OMP_THREADS_BIND``,
``service.engine.builder.bind_cpu_workers``), so TP=2 and DP=2 start on one socket.
The KV cache is sized per rank; the hidden-state layer is replicated on each. Each
layout (TP=2 on the dense and the hybrid model, DP=2 on the dense one) is one engine
at a time: the module fixture is parametrized, so pytest finishes one before the next.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from vllm.utils.cpu_resource_utils import parse_id_list

from service.engine.introspect import capacity_of
from service.engine.parallel import BIND_VARIABLE
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings, random_prompts, running
from tests.support.engines import serving

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.system,
]
#: id -> (model kind, layers, tensor-parallel size, data-parallel size)
LAYOUTS = {
    "tp2-llama": ("llama", [0, 1, 2, 4], 2, 1),
    "tp2-nemotron-h": ("nemotron-h", [1, 2, 4], 2, 1),
    "dp2-llama": ("llama", [0, 1, 2, 4], 1, 2),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(LAYOUTS))
async def parallel(
    request: pytest.FixtureRequest, model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """A started extractor in one of ``LAYOUTS``, served by hsx's app (``.test_url``)."""
    kind, layers, tp, dp = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"{request.param}-objects")
    engine = {
        "layer_ids": layers,
        "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "cpu_kvcache_space_gib": 0.01,
    }
    settings = engine_settings(model_dir(kind), str(root), engine=engine)
    bound = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    before = descendants()
    try:
        async with running(settings) as extractor, serving(settings, extractor) as url:
            extractor.test_root, extractor.test_url = root, url
            extractor.test_layout = (tp, dp)
            extractor.test_before = before
            yield extractor
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if bound is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bound


async def read(extractor: Any, key: str) -> bytes:
    return Path(extractor.test_root, key).read_bytes()


def places(parallel: Any) -> list[tuple[str, str]]:
    """(engine, rank) of every worker the layout has, as metric labels."""
    tp, dp = parallel.test_layout
    return [(str(engine), str(rank)) for engine in range(dp) for rank in range(tp)]


async def test_every_worker_is_told_apart_and_states_equal_transformers(parallel: Any) -> None:
    workers = await parallel.on_workers("hsx_memory")
    assert [(str(w["engine"]), str(w["rank"])) for w in workers] == places(parallel)
    prompts = random_prompts([1, 17, 64, 129, 300], seed=21)
    results = await asyncio.gather(
        *(parallel.extract(p, parallel.request_params("states")) for p in prompts)
    )
    assert len({r.key for r in results}) == len(prompts)  # one object per prompt
    for prompt, result in zip(prompts, results, strict=True):
        data = await read(parallel, result.key)
        assert_object_matches(
            data, parallel.settings.engine.model, prompt, parallel.layer_ids, result
        )


async def test_include_output_tokens_is_exact(parallel: Any) -> None:
    prompt = random_prompts([40], seed=22)[0]
    params = parallel.request_params("decode", include_output_tokens=True)
    result = await parallel.extract(prompt, params, max_tokens=5)
    sequence = prompt + list(result.output_token_ids[:-1])
    data = await read(parallel, result.key)
    assert_object_matches(
        data, parallel.settings.engine.model, sequence, parallel.layer_ids, result
    )


async def test_a_flood_through_a_small_cache_leaves_it_empty(parallel: Any) -> None:
    """Many more tokens than the cache holds, all answered; then a prompt that needs the
    whole cache is: no block was left held."""
    capacity = capacity_of((await parallel.on_workers("hsx_kv_layout"))[0])["tokens"]
    longest = parallel.max_model_len - 1
    assert capacity >= longest  # the setting holds one full sequence per rank
    # Four times what the layout's caches hold, whatever that is: a fixed count (it was
    # 110 prompts) flooded the smallest cache 20 times over, at 0.16 s a TP=2 step.
    lengths: list[int] = []
    while sum(lengths) <= 4 * capacity * parallel.test_layout[1]:
        lengths.append((97 * len(lengths)) % (longest - 10) + 10)
    assert sum(lengths) > 3 * capacity * parallel.test_layout[1]
    prompts = random_prompts(lengths, seed=23)
    results = await asyncio.gather(
        *(parallel.extract(p, parallel.request_params("flood")) for p in prompts)
    )
    assert [r.num_tokens for r in results] == lengths
    assert len(list(Path(parallel.test_root, "hsx", "flood").rglob("*.safetensors"))) == len(
        prompts
    )
    assert not parallel.engine.output_processor.has_unfinished_requests()
    whole = await parallel.extract(
        random_prompts([longest], seed=24)[0], parallel.request_params("flood")
    )
    assert whole.num_tokens == longest


async def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics``: family name -> its samples' (labels, value)."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{url}/metrics")).text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


async def test_metrics_show_every_worker_and_engine_once(parallel: Any) -> None:
    """Each worker's memory is its own series, each engine's KV layout too, and under
    data parallelism both engines served requests (vLLM's per-engine counter)."""
    prompts = random_prompts([30 + i for i in range(12)], seed=25)
    await asyncio.gather(
        *(parallel.extract(p, parallel.request_params("metrics")) for p in prompts)
    )
    samples = await scrape(parallel.test_url)
    for _ in range(100):  # the app samples memory in the background, from start-up
        if len(samples.get("hsx_memory_kv_cache_bytes", [])) == len(places(parallel)):
            break
        await asyncio.sleep(0.1)
        samples = await scrape(parallel.test_url)
    for field in ("total", "free", "used", "kv_cache", "model_weights"):
        series = samples[f"hsx_memory_{field}_bytes"]
        assert sorted((s["engine"], s["rank"]) for s, _ in series) == places(parallel), field
        assert all(labels["device"] == "cpu" for labels, _ in series)
    for labels, value in samples["hsx_memory_kv_cache_bytes"]:
        assert value > 0, labels
    engines = sorted({engine for engine, _ in places(parallel)})
    for name in ("hsx_kv_cache_blocks", "hsx_kv_cache_memory_bytes", "hsx_kv_cache_groups"):
        assert sorted(s["engine"] for s, _ in samples[name]) == engines, name
    per_engine: dict[str, float] = {}
    for labels, value in samples["vllm:request_success_total"]:
        per_engine[labels["engine"]] = per_engine.get(labels["engine"], 0.0) + value
    assert sorted(per_engine) == engines
    assert all(count > 0 for count in per_engine.values()), per_engine  # each engine served


def descendants() -> set[int]:
    return {process.pid for process in psutil.Process().children(recursive=True)}


def new_workers(before: set[int]) -> list[psutil.Process]:
    """vLLM's worker processes (``VLLM::Worker``, ``VLLM::Worker_TP1``) that were not
    running ``before``: this layout's, not another module's engine's."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid not in before and process.cmdline()[0].startswith("VLLM::Worker"):
                found.append(process)
        except (psutil.Error, IndexError):  # exited meanwhile
            continue
    return found


async def test_each_worker_computes_on_the_cpus_its_binding_names(parallel: Any) -> None:
    """vLLM's binding (``0|1`` here, one CPU list per rank) holds in every worker,
    although the worker is forked from a server that loaded OpenMP before vLLM set it
    (``service.engine.vllm_patches.openmp``): each worker's main thread, and every thread it started
    but hsx's writer, may run only on its rank's list; the writer's threads run on the
    other CPUs, off the forward pass (``service.engine.writer``)."""
    tp, dp = parallel.test_layout
    lists = [set(parse_id_list(cpus)) for cpus in os.environ[BIND_VARIABLE].split("|")]
    assert len(lists) == tp * dp
    workers = new_workers(parallel.test_before)
    mains = [os.sched_getaffinity(process.pid) for process in workers]
    assert sorted(map(sorted, mains)) == sorted(map(sorted, lists))  # one list each
    everywhere = set().union(*lists)
    for process, own in zip(workers, mains, strict=True):
        seen = {frozenset(os.sched_getaffinity(t.id)) for t in process.threads()}
        assert seen <= {frozenset(own), frozenset(everywhere - own)}, seen
