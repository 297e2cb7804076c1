"""The hybrid Nemotron-H (Mamba2 + attention, several KV-cache groups), writing to S3."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_asyncio
import torch

from tests.conftest import s3_settings
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import (
    PROMPT_LENGTHS,
    engine_settings,
    random_prompts,
    running,
    wait_until,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
RETRY_503 = "tests.engine.faulty:open_s3_with_503s"


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket="hsx-hybrid"
    )
    return "hsx-hybrid"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hybrid(model_dir: Any, s3_endpoint: str, bucket: str) -> Any:
    storage = s3_settings(s3_endpoint, bucket, prefix="runs").model_dump()
    settings = engine_settings(model_dir("nemotron-h"), storage.pop("url"), storage=storage)
    # The real S3 backend; its client's first attempt at each put under namespace
    # "retry*" is answered 503 SlowDown (in the worker, where the puts happen).
    async with running(settings, storage_factory=RETRY_503) as extractor:
        yield extractor


async def test_hybrid_defaults(hybrid: Any) -> None:
    assert hybrid.info.hybrid
    assert hybrid.info.num_layers == 4
    assert hybrid.layer_ids == [1, 2, 4]  # [2, L//2, L-3, L] for L = 4
    assert not hybrid.engine.vllm_config.cache_config.enable_prefix_caching


async def test_hybrid_prompts_match_transformers_through_s3(hybrid: Any, s3_admin: Any) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    results = await asyncio.gather(
        *(hybrid.extract(p, hybrid.request_params("hybrid")) for p in prompts)
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.uri == f"s3://hsx-hybrid/runs/{result.key}"
        body = s3_admin.get_object(Bucket="hsx-hybrid", Key=f"runs/{result.key}")["Body"].read()
        assert len(body) == result.size
        assert_object_matches(body, hybrid.settings.engine.model, prompt, hybrid.layer_ids, result)
    assert not hybrid.engine.output_processor.has_unfinished_requests()


async def test_one_token_last_prefill_chunk_is_exact(hybrid: Any, s3_admin: Any) -> None:
    """64k + 1 tokens alone under a 64-token budget: the last chunk is one token.

    vLLM runs such a row through the Mamba decode kernels; its CPU conv update read the
    wrong history there (0.08 relative error) until service/engine/vllm_patches/cpu_mamba.py.
    """
    for length in (65, 129):
        prompt = random_prompts([length], seed=length)[0]
        result = await hybrid.extract(prompt, hybrid.request_params("hybrid"))
        body = s3_admin.get_object(Bucket="hsx-hybrid", Key=f"runs/{result.key}")["Body"].read()
        assert_object_matches(body, hybrid.settings.engine.model, prompt, hybrid.layer_ids, result)


async def test_hybrid_output_token_states_match_transformers(hybrid: Any, s3_admin: Any) -> None:
    from tests.engine.reference import load

    prompts = random_prompts([3, 40, 70], seed=5)
    results = await asyncio.gather(
        *(
            hybrid.extract(
                p, hybrid.request_params("hybrid", include_output_tokens=True), max_tokens=6
            )
            for p in prompts
        )
    )
    model = hybrid.settings.engine.model
    for prompt, result in zip(prompts, results, strict=True):
        generated = list(result.output_token_ids)
        # vLLM's greedy tokens are transformers' greedy tokens.
        expected = (
            load(model)
            .generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0]
            .tolist()
        )
        assert prompt + generated == expected
        # The last generated token was never an input, so it has no state.
        body = s3_admin.get_object(Bucket="hsx-hybrid", Key=f"runs/{result.key}")["Body"].read()
        assert_object_matches(body, model, prompt + generated[:-1], hybrid.layer_ids, result)


async def test_a_one_token_prompt_arriving_while_another_decodes(
    hybrid: Any, s3_admin: Any
) -> None:
    """A 1-token prompt sent while another request decodes: its generated tokens are
    transformers' greedy ones and its states (generated tokens included) equal
    transformers' float32.

    vLLM pads such a prompt with a placeholder draft to a decode's two rows, and the
    Mamba prefill of that row stored the placeholder's state: its generated tokens
    diverged and their states were 0.7-1.6 off, its prompt token exact, until
    service/engine/vllm_patches/mamba_padding.py. Prompts sent at the same moment are
    scheduled together and never show it: here the 1-token prompt goes once the other
    has generated a token."""
    from tests.engine.reference import load

    model = hybrid.settings.engine.model
    long, short = random_prompts([24, 1], seed=83)
    generated_before = _generated_tokens()
    decoding = asyncio.ensure_future(
        hybrid.extract(
            long, hybrid.request_params("hybrid", include_output_tokens=True), max_tokens=48
        )
    )
    await wait_until(lambda: _generated_tokens() > generated_before, 120)
    assert _generated_tokens() > generated_before, "the long prompt never started decoding"
    result = await hybrid.extract(
        short, hybrid.request_params("hybrid", include_output_tokens=True), max_tokens=6
    )
    assert not decoding.done(), "the 1-token prompt did not run beside a decoding request"
    results = [(short, result), (long, await decoding)]
    for prompt, extraction in results:
        generated = list(extraction.output_token_ids)
        expected = (
            load(model)
            .generate(torch.tensor([prompt]), max_new_tokens=len(generated), do_sample=False)[0]
            .tolist()
        )
        assert prompt + generated == expected
        key = f"runs/{extraction.key}"
        body = s3_admin.get_object(Bucket="hsx-hybrid", Key=key)["Body"].read()
        assert_object_matches(body, model, prompt + generated[:-1], hybrid.layer_ids, extraction)


def _generated_tokens() -> float:
    """Tokens vLLM generated in this process's engines so far (its own counter)."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for family in REGISTRY.collect()
        if family.name == "vllm:generation_tokens"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


async def test_storage_metrics_equal_the_work_on_s3(hybrid: Any, s3_admin: Any) -> None:
    """Writes happen in the worker; their calls, bytes and retries reach the metrics."""
    registry = hybrid.metrics.registry

    def value(name: str, **labels: str) -> float:
        return float(registry.get_sample_value(name, {"backend": "s3", **labels}) or 0.0)

    puts = "hsx_storage_operation_duration_seconds_count"
    before = (value(puts, operation="put"), value("hsx_storage_written_bytes_total"))
    retries_before = value("hsx_storage_retries_total")
    prompts = random_prompts([5, 17, 33, 64, 90], seed=21)
    results = await asyncio.gather(
        *(hybrid.extract(p, hybrid.request_params("retry")) for p in prompts)
    )
    sizes = [
        s3_admin.head_object(Bucket="hsx-hybrid", Key=f"runs/{r.key}")["ContentLength"]
        for r in results
    ]
    assert sizes == [r.size for r in results]
    assert value(puts, operation="put") - before[0] == len(prompts)
    assert value("hsx_storage_written_bytes_total") - before[1] == sum(sizes)
    # One injected 503 per object, each retried once by botocore in the worker.
    assert value("hsx_storage_retries_total") - retries_before == len(prompts)
    assert registry.get_sample_value("hsx_writer_bytes_in_flight_bytes") == 0


@pytest.mark.parametrize("generated", [False, True], ids=["prompt", "generated"])
async def test_hybrid_selections_are_rows_of_the_full_states(
    hybrid: Any, s3_admin: Any, generated: bool
) -> None:
    """``tokens`` on the hybrid: each selection, with each codec offered, holds the rows
    (or means) of the same prompts' ``all`` objects (tests/api/test_selection.py)."""
    from tests.api.test_selection import SELECTIONS, check_selected

    def body(key: str) -> bytes:
        return bytes(s3_admin.get_object(Bucket="hsx-hybrid", Key=f"runs/{key}")["Body"].read())

    prompts = random_prompts([12, 47], seed=63)
    spans = {"loss_spans": [(2, 7)], "include_output_tokens": generated}
    max_tokens = 4 if generated else 1

    async def run(**options: Any) -> list[Any]:
        params = [hybrid.request_params("hybrid", **spans, **options) for _ in prompts]
        runs = zip(prompts, params, strict=True)
        return list(
            await asyncio.gather(*(hybrid.extract(p, q, max_tokens=max_tokens) for p, q in runs))
        )

    full = await run()
    for codec in hybrid.codecs:
        for selection in SELECTIONS:
            results = await run(codec=codec, tokens=selection)
            for prompt, whole, result in zip(prompts, full, results, strict=True):
                assert result.num_tokens == whole.num_tokens
                assert result.output_token_ids == whole.output_token_ids
                check_selected(selection, codec, body(whole.key), body(result.key), len(prompt))
