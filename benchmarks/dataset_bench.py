"""``hsx dataset run`` against one server vs ``Extractor.extract`` in-process.

``python -m benchmarks.dataset_bench`` (also a row of ``make bench``). One engine (the
tiny dense model on the CPU) serves both sides. The in-process side is
``asyncio.gather`` of every prompt's ``Extractor.extract``; the runner side is the
``hsx dataset`` command in a process of its own, reading a JSONL file, with its
manifest fsynced after every response. Every timed run gets fresh prompts (see
``benchmarks.api_bench.fresh_prompts``): new ids, so the server runs every prompt
instead of finding its object, and no prefix-cache hits on either side.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.storage_bench import Row, Timer, _ms

PROMPTS = int(os.environ.get("HSX_BENCH_DATASET_PROMPTS", "256"))
ROUNDS = int(os.environ.get("HSX_BENCH_DATASET_ROUNDS", "4"))

NOTES = f"""- **dataset runner vs in-process**: {PROMPTS} token-id prompts of 32-256 tokens.
  Runner: `hsx dataset run` in its own process against one uvicorn server on 127.0.0.1
  (`--concurrency 8 --batch-size 8`), timed by the run's own `elapsed_s` (input read,
  endpoint probe, requests, manifest appended and fsynced per response, summary).
  Baseline: `asyncio.gather` of the same prompts' `Extractor.extract` on the same
  engine. Every run gets prompts of its own (same lengths), as a dataset has; rounds
  interleaved, medians. Ratio: runner throughput / in-process throughput; target at
  least 0.95.
"""


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """The runner-vs-in-process row."""
    from benchmarks.api_bench import _serve, bench_settings
    from service.engine.extractor import Extractor

    settings = bench_settings(scratch, "dataset", max_queued_prompts=4096)
    extractor = await Extractor.start(settings)
    server, task, url = await _serve(settings, extractor)
    try:
        prompts, rounds = (32, 1) if quick else (PROMPTS, ROUNDS)
        return [await _compare(extractor, url, scratch, prompts, rounds)]
    finally:
        server.should_exit = True
        await task
        await extractor.close()


async def _compare(extractor: Any, url: str, scratch: Path, count: int, rounds: int) -> Row:
    from benchmarks.api_bench import _interleaved, fresh_prompts, prompt_lengths

    lengths = prompt_lengths(count, 0)

    async def in_process(seed: int) -> float:
        prompts = fresh_prompts(lengths, seed)
        start = time.perf_counter()
        await asyncio.gather(*(extractor.extract(p, namespace="bench") for p in prompts))
        return time.perf_counter() - start

    async def runner(seed: int) -> float:
        return await _runner(url, fresh_prompts(lengths, seed), scratch, f"s{seed}")

    i, r = await _interleaved(in_process, runner, rounds)
    return Row(
        f"dataset runner vs in-process, {count} prompts (ratio: runner / in-process throughput)",
        _ms(r),
        _ms(i),
        i / r,
        ">= 0.95",
    )


async def _runner(url: str, prompts: list[list[int]], scratch: Path, tag: str) -> float:
    """Seconds the ``hsx dataset run`` session took, from its summary."""
    source = scratch / f"dataset-{tag}.jsonl"
    source.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    output = scratch / f"dataset-out-{tag}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "dataset", "run", str(source), "--endpoint", url,
        "--output", str(output), "--concurrency", "8", "--batch-size", "8", "--no-progress",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await proc.communicate()
    summary = json.loads((output / "summary.json").read_text())
    assert proc.returncode == 0, summary
    assert summary["ok"] == len(prompts), summary
    assert summary["objects_created"] == len(prompts), summary
    return float(summary["elapsed_s"])


def main() -> None:
    import tempfile

    from benchmarks.run import _loop_factory, timed

    with (
        tempfile.TemporaryDirectory(prefix="hsx-bench-") as scratch,
        asyncio.Runner(loop_factory=_loop_factory()) as runner,
    ):
        rows = runner.run(run(Path(scratch), timed))
    for row in rows:
        print(f"| {row.name} | {row.ours} | {row.baseline} | {row.ratio:.2f} | {row.target} |")
    print(NOTES)


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
