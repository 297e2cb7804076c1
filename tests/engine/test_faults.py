"""Storage faults, slow storage and broken states under the real engine: errors reach
the caller, nothing partial or invalid is stored, memory stays under the ceiling, the
metrics count it all, the engine keeps serving."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings, random_prompts, running
from tests.engine.faulty import ZERO_TOKEN, zeroed_copy

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MIB = 1024 * 1024
FACTORY = "tests.engine.faulty:open_faulty_storage"
EXTENSION = "tests.engine.faulty.CorruptingWorkerExtension"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Slow, faulty local storage under a 1 MiB ceiling, serving a model with a zeroed
    embedding row (prompts without that token are the original model's), with a
    switch that corrupts the copied-out states of namespace ``nan*``."""
    root = tmp_path_factory.mktemp("faulty")
    model = zeroed_copy(model_dir("llama"), tmp_path_factory.mktemp("models") / "zeroed")
    settings = engine_settings(
        model,
        str(root),
        engine={"extra_args": {"enforce_eager": True, "worker_extension_cls": EXTENSION}},
        limits={"max_bytes_in_flight": MIB},
    )
    # Long enough that writes overlap even when the engine is slowed by other work
    # (CI saw a peak of one object with 50 ms: the next object came after the write).
    os.environ["HSX_TEST_WRITE_DELAY_S"] = "0.4"
    try:
        async with running(settings, storage_factory=FACTORY) as extractor:
            await extractor.on_workers("hsx_test_corrupt_states")
            extractor.test_root = root
            extractor.reference_model = str(model_dir("llama"))
            yield extractor
    finally:
        del os.environ["HSX_TEST_WRITE_DELAY_S"]


def files(root: Path, namespace: str) -> list[Path]:
    base = root / "hsx" / namespace
    return [p for p in base.rglob("*") if p.is_file()] if base.exists() else []


def sample(extractor: Any, name: str, **labels: str) -> float:
    """A sample of the extractor's metrics; 0 for a labelled series not yet created."""
    return float(extractor.metrics.registry.get_sample_value(name, labels) or 0.0)


async def test_failed_write_fails_only_that_request(slow: Any) -> None:
    from service.engine.errors import StorageWriteError

    errors_before = sample(
        slow, "hsx_storage_errors_total", backend="file", operation="put", kind="error"
    )
    prompts = random_prompts([40] * 9, seed=11)
    namespaces = ["ok", "ok", "fail", "ok", "ok", "ok", "fail", "ok", "ok"]
    outcomes = await asyncio.gather(
        *(
            slow.extract(p, slow.request_params(ns))
            for p, ns in zip(prompts, namespaces, strict=True)
        ),
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
    # The worker's failed puts reach the API process's metrics, by the error's kind.
    errors = sample(slow, "hsx_storage_errors_total", backend="file", operation="put", kind="error")
    assert errors - errors_before == 2
    assert not slow.engine.output_processor.has_unfinished_requests()
    assert (await slow.extract([9, 8, 7], slow.request_params("ok"))).num_tokens == 3


async def test_slow_storage_stays_under_the_ceiling(slow: Any) -> None:
    # 24 objects of 200 tokens x 3 layers x 128 floats = 300 KiB each, 7 MiB in all,
    # against a 1 MiB ceiling and 400 ms per write.
    prompts = random_prompts([200] * 24, seed=12)
    results = await asyncio.gather(*(slow.extract(p, slow.request_params("slow")) for p in prompts))
    assert len(results) == 24
    assert all((slow.test_root / r.key).stat().st_size == r.size for r in results)
    per_object = 200 * 3 * 128 * 4
    peak = sample(slow, "hsx_writer_bytes_in_flight_peak_bytes")
    assert per_object * 2 <= peak <= MIB  # writes overlapped, and never past the ceiling
    # Every completion is in: the last one reported what was left, nothing.
    assert sample(slow, "hsx_writer_bytes_in_flight_bytes") == 0
    assert not slow.engine.output_processor.has_unfinished_requests()


async def test_invalid_states_fail_their_prompt_and_nothing_is_stored(slow: Any) -> None:
    from service.engine.errors import InvalidStatesError

    def invalid(reason: str) -> float:
        return sample(slow, "hsx_extract_invalid_states_total", reason=reason)

    before = {reason: invalid(reason) for reason in ("non_finite", "all_zero_layer")}
    nan_prompt, *normal = random_prompts([31, 30, 45, 64, 7], seed=14)
    zero_prompt = [ZERO_TOKEN] * 12
    outcomes = await asyncio.gather(
        slow.extract(nan_prompt, slow.request_params("nan-checked")),
        *(slow.extract(p, slow.request_params("checked")) for p in normal),
        slow.extract(zero_prompt, slow.request_params("checked")),
        return_exceptions=True,
    )
    nan_error, *kept, zero_error = outcomes
    assert isinstance(nan_error, InvalidStatesError), nan_error
    assert nan_error.reason == "non_finite"
    assert f"layer ids [{slow.layer_ids[0]}] hold NaN or Inf" in str(nan_error)
    assert isinstance(zero_error, InvalidStatesError), zero_error
    assert zero_error.reason == "all_zero_layer"
    assert f"layer ids {slow.layer_ids} are all zeros" in str(zero_error)
    # Only the valid prompts' objects exist, and they are exact: batched beside the
    # broken prompts, nothing leaked into them.
    assert files(slow.test_root, "nan-checked") == []
    stored = {p.name for p in files(slow.test_root, "checked")}
    assert stored == {r.key.rsplit("/", 1)[-1] for r in kept}
    for prompt, result in zip(normal, kept, strict=True):
        data = (slow.test_root / result.key).read_bytes()
        assert_object_matches(data, slow.reference_model, prompt, slow.layer_ids, result)
    assert invalid("non_finite") - before["non_finite"] == 1
    assert invalid("all_zero_layer") - before["all_zero_layer"] == 1
    assert not slow.engine.output_processor.has_unfinished_requests()
    assert (await slow.extract([9, 8, 7], slow.request_params("checked"))).num_tokens == 3
