"""Falcon-H1 and Gemma 3, whose vLLM classes lack EAGLE-3's aux-hidden-state interface:
hsx's subclasses (service/engine/models.py) give the states exactly as transformers
computes them, in float32.

Falcon-H1 runs Mamba2 and attention side by side in each layer (a hybrid: its own KV
cache groups); Gemma 3 alternates sliding-window (16 tokens here) and global attention.
One engine per family, one at a time (the module fixture is parametrized).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings, random_prompts, running

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
LAYERS = [0, 1, 2, 3, 4]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["falcon-h1", "gemma3"])
async def wrapped(
    request: pytest.FixtureRequest, model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    root = tmp_path_factory.mktemp(f"{request.param}-objects")
    settings = engine_settings(model_dir(request.param), str(root), engine={"layer_ids": LAYERS})
    async with running(settings) as extractor:
        extractor.test_root = root
        yield extractor


async def test_concurrent_prompts_and_output_tokens_match_transformers(wrapped: Any) -> None:
    """Prompts over one and two prefill chunks, each with 3 generated tokens stored."""
    prompts = random_prompts([1, 5, 17, 40, 64, 65, 100, 129], seed=81)
    params = [wrapped.request_params("states", include_output_tokens=True) for _ in prompts]
    runs = zip(prompts, params, strict=True)
    results = await asyncio.gather(*(wrapped.extract(p, q, max_tokens=4) for p, q in runs))
    for prompt, result in zip(prompts, results, strict=True):
        sequence = prompt + list(result.output_token_ids[:-1])
        data = Path(wrapped.test_root, result.key).read_bytes()
        assert_object_matches(data, wrapped.settings.engine.model, sequence, LAYERS, result)
    assert not wrapped.engine.output_processor.has_unfinished_requests()
    # hsx's class served it, eagerly (its hooks would not run in a compiled forward).
    assert wrapped.engine.vllm_config.model_config.enforce_eager
