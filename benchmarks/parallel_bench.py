"""Tensor and data parallelism against one rank: extraction throughput on this machine.

``python -m benchmarks.run --only parallel_bench [--quick]``. Each layout (TP=1, TP=2,
DP=2) runs in a process of its own, one engine alive at a time, so no layout inherits
another's thread binding; the layouts are measured in ABCCBA order and each layout's
throughput is the median of all its rounds. Rows: TP=2 / TP=1 and DP=2 / TP=1, each
with the binding its workers got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Preforked,
    Row,
    Timer,
    bench_settings,
    fork_engine_server,
    fresh_prompts,
    last_json,
)

#: layout name -> (tensor-parallel size, data-parallel size)
LAYOUTS = {"TP=1": (1, 1), "TP=2": (2, 1), "DP=2": (1, 2)}
#: The order of the full run: every layout twice, mirrored, so drift hits all alike.
ORDER = ("TP=1", "TP=2", "DP=2", "DP=2", "TP=2", "TP=1")
QUICK_ORDER = ("TP=1", "TP=2", "DP=2")
HIDDEN = 512
ROW_PREFIXES = ("TP=2 vs TP=1", "DP=2 vs TP=1")


@dataclass(frozen=True)
class Size:
    """How much one layout's process does."""

    prompts: int
    length: int
    rounds: int


FULL = Size(prompts=64, length=256, rounds=3)
QUICK = Size(prompts=4, length=64, rounds=1)

NOTES = f"""- **parallel layouts**: the tiny random Llama (hidden {HIDDEN}, 4 layers, float32,
  eager), extraction of 4 layers to local disk, {FULL.prompts} prompts of
  {FULL.length} tokens in flight per round (fresh prompts every round), {FULL.rounds}
  rounds per process. Each layout runs in a process of its own (forked from one
  process that imported vLLM once: `benchmarks/preforked.py`) in the order
  {", ".join(ORDER)} (one engine alive at a time, none inheriting another's thread
  binding); a layout's throughput is the median of its rounds in both processes. The
  binding column is `VLLM_CPU_OMP_THREADS_BIND` as the engine's workers got it: hsx
  sets it for more than one rank (`service/engine/builder.py::bind_cpu_workers`),
  TP=1 keeps vLLM's `auto`. On 2 cores, TP=2 and DP=2 each give a rank one core:
  what they can gain over TP=1 is what TP=1 leaves idle (docs/cpu.md); on a GPU host
  each rank has its own device and the same rows measure scaling.
"""


async def measure(layout: str, size: Size, scratch: Path) -> dict[str, object]:
    """One layout in this process: seconds of each round and the binding it ran with."""
    from service.engine.extractor import Extractor

    tp, dp = LAYOUTS[layout]
    settings = bench_settings(scratch, "parallel", hidden_size=HIDDEN, eager=True)
    engine = settings.engine.model_copy(
        update={"tensor_parallel_size": tp, "data_parallel_size": dp}
    )
    settings = settings.model_copy(update={"engine": engine})
    extractor = await Extractor.start(settings)
    try:
        binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (vLLM's default)")
        warm = fresh_prompts([size.length] * 2, seed=-1, salt=layout)
        await _extract_all(extractor, warm)
        seconds = []
        for round_ in range(size.rounds):
            prompts = fresh_prompts([size.length] * size.prompts, seed=round_, salt=layout)
            start = time.perf_counter()
            await _extract_all(extractor, prompts)
            seconds.append(time.perf_counter() - start)
        return {"seconds": seconds, "binding": binding, "tokens": size.prompts * size.length}
    finally:
        await extractor.close()


async def _extract_all(extractor: Any, prompts: list[list[int]]) -> None:
    """Every prompt at once, each under a key of its own."""
    await asyncio.gather(
        *(extractor.extract(p, extractor.request_params("bench")) for p in prompts)
    )


#: What a layout's process imports before its engine starts (``Preforked``).
LAYOUT_PRELOAD = (
    "vllm.v1.engine.async_llm",
    "service.engine.extractor",
    "benchmarks.parallel_bench",
)


async def _in_own_process(
    layouts: Preforked, layout: str, size: Size, scratch: Path
) -> dict[str, object]:
    """``measure`` in a process of its own (forked from ``layouts``, which imported
    vLLM once), started without hsx's or vLLM's binding variable."""
    args = ["--layout", layout, "--size", json.dumps(size.__dict__), "--scratch", str(scratch)]
    out = await layouts.run("benchmarks.parallel_bench", *args, log=scratch.with_suffix(".log"))
    return last_json(out)


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """TP=2 and DP=2 throughput against TP=1, each layout in its own process."""
    del timer  # each layout times itself in its own process
    size = QUICK if quick else FULL
    seconds: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    bindings: dict[str, str] = {}
    tokens = size.prompts * size.length
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    async with Preforked.start(LAYOUT_PRELOAD, scratch / "layouts.log", env) as layouts:
        for layout in QUICK_ORDER if quick else ORDER:
            found = await _in_own_process(layouts, layout, size, scratch / layout)
            seconds[layout] += [float(s) for s in found["seconds"]]  # type: ignore[attr-defined]
            bindings[layout] = str(found["binding"])
    rate = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    base = rate["TP=1"]
    return [
        Row(
            f"{name} vs TP=1, extraction, {size.prompts}x{size.length} tokens, hidden "
            f"{HIDDEN}, local disk (ratio: throughput; binding {bindings[name]} vs "
            f"{bindings['TP=1']})",
            f"{rate[name]:.0f} tok/s",
            f"{base:.0f} tok/s",
            rate[name] / base,
            "info",
        )
        for name in ("TP=2", "DP=2")
    ]


def main() -> None:
    """One layout in this process (the bench starts it): its result is the last stdout
    line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=list(LAYOUTS), required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--scratch", required=True)
    args = parser.parse_args()
    size = Size(**json.loads(args.size))
    fork_engine_server()
    found = asyncio.run(measure(args.layout, size, Path(args.scratch)))
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
