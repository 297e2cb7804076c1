"""Engines shared per module: starting one takes 15-25 s on these CPUs."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest_asyncio

from service.config import Settings

# Re-exported: tests.api and the engine tests import it from here.
from tests.support.engines import engine_settings as engine_settings


@contextlib.asynccontextmanager
async def running(settings: Settings, storage_factory: str | None = None) -> AsyncIterator[Any]:
    from service.engine.extractor import Extractor

    extractor = await Extractor.start(settings, storage_factory=storage_factory)
    try:
        yield extractor
    finally:
        await extractor.close()


async def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Return once ``condition()`` holds; give up (without raising) after ``timeout_s``,
    leaving the caller's assertion to say what was wrong."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def engine_requests() -> float:
    """Requests the engine finished (any reason), from vLLM's own counter.

    vLLM keeps its metrics in this process's default registry (the one ``/metrics``
    serves beside ours); a request that reached the engine moves this count.
    """
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for family in REGISTRY.collect()
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# 36 prompts from 1 to 450 tokens: several prefill chunks of 64, up to 28+ blocks of 16.
PROMPT_LENGTHS = [
    1,
    2,
    3,
    5,
    8,
    13,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    65,
    100,
    127,
    128,
    129,
    150,
    180,
    200,
    230,
    255,
    256,
    257,
    290,
    310,
    333,
    350,
    377,
    400,
    420,
    433,
    440,
    449,
    450,
]

__all__ = [
    "PROMPT_LENGTHS",
    "engine_requests",
    "engine_settings",
    "pytest_asyncio",
    "random_prompts",
    "running",
    "wait_until",
]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.engine.checks import WORST

    for model, error in WORST.items():
        terminalreporter.write_line(
            f"hsx: worst relative error vs transformers, {model}: {error:.2e}"
        )
