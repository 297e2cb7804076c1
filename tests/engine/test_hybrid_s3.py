"""The hybrid Nemotron-H (Mamba2 + attention, several KV-cache groups), writing to S3."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import s3_settings
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import PROMPT_LENGTHS, engine_settings, random_prompts, running

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


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
    async with running(settings) as extractor:
        yield extractor


async def test_hybrid_defaults(hybrid: Any) -> None:
    assert hybrid.info.hybrid
    assert hybrid.info.num_layers == 4
    assert hybrid.layer_ids == [1, 2, 4]  # [2, L//2, L-3, L] for L = 4
    assert not hybrid.engine.vllm_config.cache_config.enable_prefix_caching


@pytest.mark.xfail(
    strict=False,
    reason="issue 3 open: in a fresh-clone CI run one 17-token hybrid prompt came back with "
    "a 0.139 relative error in the first Mamba layer (intermittent: 2 of 3 fresh-clone "
    "runs); cause not yet isolated between vLLM's CPU Mamba path and our copy-out",
)
async def test_hybrid_prompts_match_transformers_through_s3(hybrid: Any, s3_admin: Any) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    results = await asyncio.gather(*(hybrid.extract(p, namespace="hybrid") for p in prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.uri == f"s3://hsx-hybrid/runs/{result.key}"
        body = s3_admin.get_object(Bucket="hsx-hybrid", Key=f"runs/{result.key}")["Body"].read()
        assert len(body) == result.size
        assert_object_matches(body, hybrid.settings.engine.model, prompt, hybrid.layer_ids, result)
    assert not hybrid.engine.output_processor.has_unfinished_requests()


async def test_hybrid_refuses_output_token_states(hybrid: Any, s3_admin: Any) -> None:
    """vLLM's hybrid decode under extract_hidden_states is not exact: refuse, store nothing."""
    from service.engine.extractor import InvalidPromptError

    before = s3_admin.list_objects_v2(Bucket="hsx-hybrid").get("KeyCount", 0)
    with pytest.raises(InvalidPromptError, match="include_output_tokens"):
        await hybrid.extract(
            [5, 6, 7], namespace="hybrid", max_tokens=5, include_output_tokens=True
        )
    assert s3_admin.list_objects_v2(Bucket="hsx-hybrid").get("KeyCount", 0) == before
    # Prompt states with several generated tokens are still exact.
    prompt = random_prompts([70], seed=3)[0]
    result = await hybrid.extract(prompt, namespace="hybrid", max_tokens=5)
    body = s3_admin.get_object(Bucket="hsx-hybrid", Key=f"runs/{result.key}")["Body"].read()
    assert_object_matches(body, hybrid.settings.engine.model, prompt, hybrid.layer_ids, result)
