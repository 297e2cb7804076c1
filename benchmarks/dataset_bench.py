"""``hsx dataset run`` against one server vs ``Extractor.extract`` in-process.

``python -m benchmarks.run --only dataset_bench [--quick]``. One engine (the tiny dense
model on the CPU) serves both sides. The in-process side is
``asyncio.gather`` of every prompt's ``Extractor.extract``; the runner side is the
``hsx dataset`` command in a process of its own, reading a JSONL file, with its
manifest fsynced after every response. Every timed run gets fresh prompts (see
``benchmarks.common.fresh_prompts``): new ids, so the server runs every prompt
instead of finding its object, and no prefix-cache hits on either side.

After the timed rounds, ``verify --parity`` (``service.dataset.parity``) runs on the last
round's output: its cost per sampled row against the run's own time per row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CpuSeconds,
    Row,
    Timer,
    bench_settings,
    cpu_seconds,
    cpu_text,
    fresh_prompts,
    interleaved,
    ms,
    prompt_lengths,
    serve,
)

PROMPTS = int(os.environ.get("HSX_BENCH_DATASET_PROMPTS", "256"))
ROUNDS = int(os.environ.get("HSX_BENCH_DATASET_ROUNDS", "4"))
CONCURRENCY = int(os.environ.get("HSX_BENCH_DATASET_CONCURRENCY", "8"))
BATCH = int(os.environ.get("HSX_BENCH_DATASET_BATCH", "8"))
HIDDEN = int(os.environ.get("HSX_BENCH_DATASET_HIDDEN", "512"))
LAYERS = int(os.environ.get("HSX_BENCH_DATASET_LAYERS", "4"))
PARITY_ROWS = int(os.environ.get("HSX_BENCH_DATASET_PARITY_ROWS", "16"))
#: The starts of this bench's rows, which ``run.py --only dataset_bench`` replaces.
ROW_PREFIXES = ("dataset runner vs in-process", "verify --parity")

NOTES = f"""- **dataset runner vs in-process**: {PROMPTS} token-id prompts of 32-256 tokens.
  Runner: `hsx dataset run` in its own process against one uvicorn server on 127.0.0.1
  (`--concurrency {CONCURRENCY} --batch-size {BATCH}`), timed by the run's own
  `elapsed_s` (input read, endpoint probe, requests, manifest appended and fsynced
  per response, summary). Baseline: `asyncio.gather` of the same prompts'
  `Extractor.extract` on the same engine. Every run gets prompts of its own (same
  lengths), as a dataset has; rounds interleaved, medians. Ratio: runner throughput /
  in-process throughput. The row names the CPU seconds each process spent per round
  (medians): the runner process, this process (the API server, or the in-process
  caller) and the engine's processes. Two models: the target row (at least 0.95) uses
  a random Llama of hidden {HIDDEN} and {LAYERS} layers, whose forward pass does some
  work; the info row, the tiny demo model (hidden 128), whose forward pass costs next
  to nothing, so what it shows is the HTTP path's overhead. That overhead is about the
  same CPU in both (runner about 0.5 s, server about 0.2 s more than in-process, per
  256 prompts), while the engine's 2 cores have nothing to spare: on the tiny model it
  is about a tenth of the round. A real model's forward pass makes it smaller still.
  Random weights: the shapes are realistic, the activations are not (they do not
  affect these timings).
- **verify --parity**: after the timed rounds, `parity_check` on the last round's
  output: {PARITY_ROWS} rows sampled over lengths (32-256 tokens), each fetched through
  the server, decoded, and recomputed by transformers (float32, eager, this CPU, one
  row at a time) with every stored layer compared. Ours: its seconds per sampled row
  (the model's load, once per verify, is named in the row and not included).
  Baseline: the run's own `elapsed_s` per ok row (a row's share of the whole run, with
  the engine batching). Ratio: what parity costs per row, in rows of extraction: K
  sampled rows cost about K x ratio rows of the run. Random weights: on a real model
  the ratio depends on how transformers' forward pass compares with vLLM's on it (not
  measured here).
"""


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """The runner-vs-in-process rows: the target on a model whose forward pass does real
    work, and (full mode) the same on the tiny demo model, where overheads dominate."""
    models = [(HIDDEN, LAYERS, ">= 0.95"), (128, 4, "info")]
    if quick:  # the bench's every path once: the tiny model, one round, few prompts
        models = models[-1:]
    prompts, rounds = (16, 1) if quick else (PROMPTS, ROUNDS)
    rows = []
    for hidden, layers, target in models:
        rows += await _model_row(scratch, hidden, layers, prompts, rounds, target, quick)
    return rows


async def _model_row(
    scratch: Path,
    hidden: int,
    layers: int,
    prompts: int,
    rounds: int,
    target: str,
    eager: bool = False,
) -> list[Row]:
    """The runner-vs-in-process row of one model, and its ``verify --parity`` row."""
    from service.engine.extractor import Extractor

    name = f"dataset-{hidden}x{layers}"
    settings = bench_settings(
        scratch,
        name,
        hidden_size=hidden,
        num_layers=layers,
        eager=eager,
        max_queued_prompts=4096,
    )
    extractor = await Extractor.start(settings)
    server, task, url = await serve(settings, extractor)
    (scratch / name).mkdir(exist_ok=True)
    model = f"hidden {hidden}, {layers} layers"
    try:
        row, output = await _compare(extractor, url, scratch / name, prompts, rounds)
        k = 4 if eager else PARITY_ROWS  # eager: the quick mode
        parity = await _parity_row(url, output, str(settings.engine.model), k, model)
    finally:
        server.should_exit = True
        await task
        await extractor.close()
    row = dataclasses.replace(
        row, name=row.name.replace(" prompts", f" prompts, {model}", 1), target=target
    )
    return [row, parity]


async def _parity_row(url: str, output: Path, model: str, k: int, described: str) -> Row:
    """``verify --parity k`` on a finished run: seconds per sampled row vs the run's."""
    from service.client import AsyncHsxClient
    from service.dataset.parity import parity_check
    from service.dataset.store import RunStore
    from service.dataset.verify import run_stores

    root = RunStore(str(output))
    try:
        async with AsyncHsxClient(url, None, timeout=120) as client:
            report = await parity_check(client, root, await run_stores(root), k, model=model)
    finally:
        await root.close()
    assert report.ok, report.lines()
    summary = json.loads((output / "summary.json").read_text())
    per_row, run_row = report.compare_s / len(report.rows), summary["elapsed_s"] / summary["ok"]
    return Row(
        f"verify --parity, {described}: time per sampled row vs the run's per row "
        f"({len(report.rows)} rows of 32-256 tokens, transformers float32 on "
        f"{os.cpu_count()} CPU cores, random weights; model load {report.load_s:.1f} s "
        "once per verify, not included)",
        ms(per_row),
        ms(run_row),
        per_row / run_row,
        "info",
    )


async def _compare(
    extractor: Any, url: str, scratch: Path, count: int, rounds: int
) -> tuple[Row, Path]:
    """The runner-vs-in-process row, and the output of the runner's last round."""
    lengths = prompt_lengths(count, 0)
    outputs: list[Path] = []

    cpu: dict[str, list[CpuSeconds]] = {"in-process": [], "runner": []}

    async def in_process(seed: int) -> float:
        prompts = fresh_prompts(lengths, seed)
        with cpu_seconds(cpu["in-process"]):
            start = time.perf_counter()
            await asyncio.gather(
                *(extractor.extract(p, extractor.request_params("bench")) for p in prompts)
            )
            return time.perf_counter() - start

    async def runner(seed: int) -> float:
        outputs.append(scratch / f"dataset-out-s{seed}")
        with cpu_seconds(cpu["runner"]):
            return await _runner(url, fresh_prompts(lengths, seed), scratch, f"s{seed}")

    i, r = await interleaved(in_process, runner, rounds)
    row = Row(
        f"dataset runner vs in-process, {count} prompts (ratio: runner / in-process "
        f"throughput; CPU s per round: {cpu_text(cpu)})",
        ms(r),
        ms(i),
        i / r,
        ">= 0.95",
    )
    return row, outputs[-1]


async def _runner(url: str, prompts: list[list[int]], scratch: Path, tag: str) -> float:
    """Seconds the ``hsx dataset run`` session took, from its summary."""
    source = scratch / f"dataset-{tag}.jsonl"
    source.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    output = scratch / f"dataset-out-{tag}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "dataset", "run", str(source), "--endpoint", url,
        "--output", str(output), "--concurrency", str(CONCURRENCY),
        "--batch-size", str(BATCH), "--no-progress",
        stdout=asyncio.subprocess.PIPE,
        # hsx refuses HSX_ variables that are not settings: the bench's own stay here.
        env={k: v for k, v in os.environ.items() if not k.startswith("HSX_BENCH_")},
    )  # fmt: skip
    await proc.communicate()
    summary = json.loads((output / "summary.json").read_text())
    assert proc.returncode == 0, summary
    assert summary["ok"] == len(prompts), summary
    assert summary["objects_created"] == len(prompts), summary
    return float(summary["elapsed_s"])
