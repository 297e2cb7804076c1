"""Exact hidden states from the real vLLM engine on CPU: dense model, local disk."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from safetensors.torch import load

from service.engine.builder import served_model_name
from tests.engine.checks import assert_object_matches, object_metadata
from tests.engine.conftest import (
    PROMPT_LENGTHS,
    engine_settings,
    random_prompts,
    running,
    wait_until,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llama(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("objects")
    settings = engine_settings(model_dir("llama"), str(root), engine={"layer_ids": [0, 1, 2, 4]})
    async with running(settings) as extractor:
        extractor.test_root = root
        yield extractor


async def read(extractor: Any, key: str) -> bytes:
    return (extractor.test_root / key).read_bytes()


async def test_concurrent_prompts_match_transformers(llama: Any) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    results = await asyncio.gather(
        *(llama.extract(p, llama.request_params("dense")) for p in prompts)
    )
    assert len({r.key for r in results}) == len(prompts)
    for prompt, result in zip(prompts, results, strict=True):
        data = await read(llama, result.key)
        assert len(data) == result.size
        assert hashlib.sha256(data).hexdigest() == result.sha256
        assert_object_matches(data, llama.settings.engine.model, prompt, [0, 1, 2, 4], result)
    assert not llama.engine.output_processor.has_unfinished_requests()


async def test_metadata_names_model_layers_dtype_and_caller_strings(llama: Any) -> None:
    result = await llama.extract(
        [5, 6, 7], llama.request_params("dense", metadata={"run": "r1", "model": "x"})
    )
    meta = object_metadata(await read(llama, result.key))
    assert meta["layer_ids"] == "[0, 1, 2, 4]"
    assert meta["dtype"] == "float32"
    assert meta["format_version"] == "1"
    assert meta["model"] == served_model_name(llama.info.name)  # a caller cannot override ours
    assert meta["run"] == "r1"


async def test_include_output_tokens_stores_generated_states(llama: Any) -> None:
    prompt = random_prompts([40], seed=7)[0]
    result = await llama.extract(
        prompt, llama.request_params("dense", include_output_tokens=True), max_tokens=6
    )
    assert len(result.output_token_ids) == 6
    # The last generated token was never an input, so it has no state.
    sequence = prompt + list(result.output_token_ids[:-1])
    data = await read(llama, result.key)
    assert_object_matches(data, llama.settings.engine.model, sequence, [0, 1, 2, 4], result)


async def test_without_include_output_tokens_only_the_prompt_is_stored(llama: Any) -> None:
    prompt = random_prompts([20], seed=8)[0]
    result = await llama.extract(prompt, llama.request_params("dense"), max_tokens=4)
    assert load(await read(llama, result.key))["token_ids"].tolist() == prompt


async def test_cancelled_requests_leave_nothing_and_engine_serves(llama: Any) -> None:
    """vLLM's own abort test, through hsx: 100 requests, every 10th cancelled."""
    prompts = random_prompts([30 + i % 50 for i in range(100)], seed=9)
    before = set(_objects(llama.test_root / "hsx" / "cancel"))
    tasks = [
        asyncio.create_task(llama.extract(p, llama.request_params("cancel"), max_tokens=20))
        for p in prompts
    ]
    await asyncio.sleep(0.05)
    for task in tasks[::10]:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    kept = [o for i, o in enumerate(outcomes) if i % 10]
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes[::10])
    assert all(not isinstance(o, BaseException) for o in kept), kept
    # Objects of cancelled requests whose states were already copied out are removed
    # when their late completions arrive: wait for exactly the kept ones to remain.
    expected = {o.key.split("/")[-1] for o in kept}

    def remaining() -> set[str]:
        return set(_objects(llama.test_root / "hsx" / "cancel")) - before

    await wait_until(lambda: remaining() == expected, timeout_s=30)
    assert remaining() == expected
    assert not llama.engine.output_processor.has_unfinished_requests()
    again = await llama.extract([1, 2, 3], llama.request_params("cancel"))
    assert again.num_tokens == 3


def _objects(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*.safetensors")] if root.exists() else []


async def test_two_prompts_under_one_key_in_flight_both_get_an_answer(llama: Any) -> None:
    """Different prompts under one key at once (one custom_id, two different requests):
    the first stores its object, the second's create-only write fails, and neither
    waits forever. Completions name only their key: both once waited on one slot."""
    from service.engine.errors import ExtractionError

    first, second = random_prompts([20, 33], seed=31)
    key = llama.request_params("same-key").key
    params = llama.request_params("same-key", key=key)
    results = await asyncio.wait_for(
        asyncio.gather(
            llama.extract(first, params), llama.extract(second, params), return_exceptions=True
        ),
        timeout=120,
    )
    assert results[0].key == key, results  # the first call holds the key first
    assert isinstance(results[1], ExtractionError), results
    assert "already exists" in str(results[1])
    stored = load(await read(llama, key))["token_ids"].tolist()
    assert stored == first
