"""The sides the engine bench compares, and its interleaved rounds.

A side is one way of doing a prompt set's work (extraction, plain requests, the
transformers pipeline); ``rounds`` times every side on the same prompts in turn.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Timer
from benchmarks.hf_pipeline import HfPipeline, Sink

Prompts = list[list[int]]
Medians = dict[str, float]  # median seconds of a prompt set, per side
WARM_PROMPTS = 2  # per side, before any timed round


async def _nothing() -> None:
    return None


@dataclass
class Side:
    """One way of doing a set's work; ``clear`` (untimed) removes what it stored."""

    run: Callable[[Prompts], Awaitable[object]]
    clear: Callable[[], Awaitable[object]] = _nothing


async def rounds(sides: dict[str, Side], prompts: Prompts, count: int, timer: Timer) -> Medians:
    """Median seconds per side over ``count`` rounds, the order rotating each round
    (after every side ran the first prompts once, untimed)."""
    for side in sides.values():
        await side.run(prompts[:WARM_PROMPTS])
        await side.clear()
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(count):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            side = sides[name]
            times[name] += await timer(functools.partial(side.run, prompts), 1)
            await side.clear()
    return {name: statistics.median(t) for name, t in times.items()}


def plain_side(engine: Any) -> Side:
    """Plain requests: one output token, no hsx parameters (nothing is saved)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    async def one(prompt: list[int]) -> None:
        request = TokensPrompt(prompt_token_ids=prompt)
        async for _ in engine.generate(request, sampling, f"bench-{uuid.uuid4().hex}"):
            pass

    async def run(prompts: Prompts) -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    return Side(run)


def extraction_side(extractor: Any) -> Side:
    """``Extractor.extract`` of every prompt; the objects are deleted between rounds."""
    keys: list[str] = []

    async def run(prompts: Prompts) -> None:
        done = await asyncio.gather(
            *(extractor.extract(p, extractor.request_params("bench")) for p in prompts)
        )
        keys.extend(r.key for r in done)

    async def clear() -> None:
        await asyncio.gather(*(extractor.storage.delete(k) for k in keys))
        keys.clear()

    return Side(run, clear)


def hf_side(pipeline: HfPipeline, sink: Sink) -> Side:
    """The transformers pipeline writing to ``sink``; its files are removed between rounds."""

    async def run(prompts: Prompts) -> None:
        await asyncio.to_thread(pipeline.run, prompts, sink)

    async def clear() -> None:
        await asyncio.to_thread(sink.clear)

    return Side(run, clear)
