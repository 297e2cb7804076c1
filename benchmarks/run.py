"""``make bench``: speed measured as ratios, side by side in one run.

Results go to stdout and to ``docs/benchmarks.md``. Each pair runs interleaved on the
same data, so a noisy machine slows both sides alike; the ratio is what we track.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from benchmarks import (
    api_bench,
    codec_bench,
    copy_bench,
    dataset_bench,
    engine_bench,
    storage_bench,
    validation_bench,
)

#: Benches on the engine, in the order of the table; each takes ``quick``.
ENGINE_BENCHES = (api_bench, codec_bench, dataset_bench, engine_bench)

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


async def timed(fn: Callable[[], Awaitable[object]], repeats: int) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return times


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmarks, written to docs/benchmarks.md.")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized runs: checks every bench works; prints, leaves docs/benchmarks.md",
    )
    quick = parser.parse_args().quick
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as scratch:
        rows = asyncio.run(storage_bench.run(Path(scratch), timed))
        rows += asyncio.run(validation_bench.run(Path(scratch), timed))
        rows += asyncio.run(copy_bench.run(Path(scratch), timed, quick=quick))
        # The event loop `hsx serve` gets from uvicorn (uvloop when installed), for
        # both sides of the comparison.
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            for bench in ENGINE_BENCHES:
                rows += runner.run(bench.run(Path(scratch), timed, quick=quick))
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench`. Ratios compare two ways of doing the same work in one run",
        "on the same machine; absolute times depend on the machine (described under the",
        "engine rows below). Where extraction's time goes, and what was tried to cut it:",
        "[profile.md](profile.md).",
        "",
        "| benchmark | ours | baseline | ratio (ours / baseline) | target |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.ours} | {row.baseline} | {row.ratio:.2f} | {row.target} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    notes = (
        storage_bench.NOTES
        + validation_bench.NOTES
        + copy_bench.NOTES
        + "".join(bench.NOTES for bench in ENGINE_BENCHES)
    )
    if not quick:
        DOC.write_text(text + "\n" + notes)


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
