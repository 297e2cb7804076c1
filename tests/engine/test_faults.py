"""Storage faults and slow storage under the real engine: errors reach the caller,
nothing partial remains, memory stays under the ceiling, the engine keeps serving."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.engine.conftest import engine_settings, random_prompts, running

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MIB = 1024 * 1024
FACTORY = "tests.engine.faulty:open_faulty_storage"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("faulty")
    settings = engine_settings(model_dir("llama"), str(root), limits={"max_bytes_in_flight": MIB})
    os.environ["HSX_TEST_WRITE_DELAY_S"] = "0.05"
    try:
        async with running(settings, storage_factory=FACTORY) as extractor:
            extractor.test_root = root
            yield extractor
    finally:
        del os.environ["HSX_TEST_WRITE_DELAY_S"]


def files(root: Path, namespace: str) -> list[Path]:
    base = root / "hsx" / namespace
    return [p for p in base.rglob("*") if p.is_file()] if base.exists() else []


async def test_failed_write_fails_only_that_request(slow: Any) -> None:
    from service.engine.extractor import StorageWriteError

    prompts = random_prompts([40] * 9, seed=11)
    namespaces = ["ok", "ok", "fail", "ok", "ok", "ok", "fail", "ok", "ok"]
    outcomes = await asyncio.gather(
        *(slow.extract(p, namespace=ns) for p, ns in zip(prompts, namespaces, strict=True)),
        return_exceptions=True,
    )
    for ns, outcome in zip(namespaces, outcomes, strict=True):
        if ns == "fail":
            assert isinstance(outcome, StorageWriteError)
            assert "injected write failure" in str(outcome)
        else:
            assert not isinstance(outcome, BaseException), outcome
            assert (slow.test_root / outcome.key).stat().st_size == outcome.size
    assert files(slow.test_root, "fail") == []
    assert not slow.engine.output_processor.has_unfinished_requests()
    assert (await slow.extract([9, 8, 7], namespace="ok")).num_tokens == 3


async def test_slow_storage_stays_under_the_ceiling(slow: Any) -> None:
    # 24 objects of 200 tokens x 3 layers x 128 floats = 300 KiB each, 7 MiB in all,
    # against a 1 MiB ceiling and 50 ms per write.
    slow.peak_bytes_in_flight = 0
    prompts = random_prompts([200] * 24, seed=12)
    results = await asyncio.gather(*(slow.extract(p, namespace="slow") for p in prompts))
    assert len(results) == 24
    assert all((slow.test_root / r.key).stat().st_size == r.size for r in results)
    per_object = 200 * 3 * 128 * 4
    assert per_object * 2 <= slow.peak_bytes_in_flight <= MIB
    assert not slow.engine.output_processor.has_unfinished_requests()
