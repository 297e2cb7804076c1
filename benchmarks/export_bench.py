"""Trainer exports of one SmolLM2 run: each layout's throughput and size.

``python -m benchmarks.run --only export_bench [--quick]``. One engine serves the demo
model (SmolLM2-135M-Instruct) in bfloat16; ``hsx dataset run --loss assistant`` stores
a set of chats once, then every layout of ``hsx dataset export`` is written from that
run in a process of its own (as a user runs it), rounds interleaved, and the run's
objects are also fetched alone, with the export's concurrency, in a process of their
own: what every export must do before converting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Row, Timer, last_json, serve

CHATS = int(os.environ.get("HSX_BENCH_EXPORT_CHATS", "64"))
ROUNDS = int(os.environ.get("HSX_BENCH_EXPORT_ROUNDS", "3"))
CONCURRENCY = 8  # the export's default
MODEL_DIR = REPO / "var/models/SmolLM2-135M-Instruct"
TEXTS = Path(__file__).resolve().parent / "real_model_texts.json"
#: Each layout's name in the rows, and its flags.
LAYOUTS = {
    "speculators": ["--format", "speculators"],
    "SpecForge EAGLE-3": ["--format", "specforge"],
    "SpecForge EAGLE-3 gzip": ["--format", "specforge", "--compress"],
    "SpecForge DFlash": ["--format", "specforge", "--specforge-layout", "dflash"],
    "ModelOpt": ["--format", "modelopt"],
    "EAGLE": ["--format", "eagle"],
}
#: The starts of this bench's rows, which ``run.py --only export_bench`` replaces.
ROW_PREFIXES = ("trainer export",)

NOTES = f"""- **trainer export rows**: `hsx dataset export` of one run in every trainer layout
  (`docs/trainers.md`, "Trainer layouts"). The run: SmolLM2-135M-Instruct served in
  bfloat16 with EAGLE-3's default layer ids [2, 15, 27, 30], {CHATS} one-turn chats
  (`quick`: 4) from `benchmarks/real_model_texts.json` (a question and its answer, each
  chat with a system prompt of its own), loss masks on the assistant turns, the `raw`
  codec. Each export runs in a process of its own (`--model` the demo model's
  directory) against the server on 127.0.0.1; its time is the export's own `samples_s`
  from `hsx-export.json`: reading every object through the server, converting and
  writing it (and speculators' Arrow rows), not the interpreter's start, torch's
  import, the run's state or the model's weights hash (the whole export's time is its
  `elapsed_s`, a few seconds more).
  {ROUNDS} rounds (`quick`: 1), the layouts' order rotated each round, medians.
- **throughput**: megabytes written per second, and tokens per second. Baseline: the
  run's objects fetched alone (`GET /objects/{{key}}`, {CONCURRENCY} at a time, the
  export's concurrency, nothing converted or written) in a process of its own, timed
  the same way. Ratio: export tokens/s over fetch tokens/s (1.0 would be an export as
  fast as reading the objects). The layouts that want the last layer after the final
  norm (SpecForge EAGLE-3, ModelOpt, EAGLE) apply SmolLM2's RMSNorm to it on the CPU;
  gzip (level 6) runs on one core.
- **bytes per 1M tokens**: what the export writes (sample files only; the Arrow rows
  of speculators are counted, the manifest and length index are not) per million
  prompt tokens, against hsx's own objects of the same run (4 layers, bf16,
  safetensors with int64 token ids and a uint8 mask). EAGLE-3 layouts store the three
  aux layers and the last (4 x 576 x 2 bytes a token, plus int64 ids and mask); DFlash
  the three aux layers; EAGLE the last layer only; multiply by H / 576 for hidden H.
"""


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """Every layout's throughput and size rows. ``timer`` is unused: each export times
    its samples itself (its ``samples_s``), leaving out its process's start-up."""
    del timer
    from service import demo_model

    model = demo_model.prepare(MODEL_DIR)
    chats, rounds = _chats(4 if quick else CHATS), 1 if quick else ROUNDS
    async with _server(model, scratch) as url:
        output, summary = await _dataset_run(url, chats, scratch)
        fetched: list[dict[str, Any]] = []
        exported: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
        names = list(LAYOUTS)
        for round_ in range(rounds):
            fetched.append(await _fetch_child(url, output, scratch))
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                exported[name].append(await _export(url, output, model, name, scratch))
    return _rows(summary, fetched, exported, len(chats))


def _chats(count: int) -> list[dict[str, Any]]:
    """``count`` one-turn chats, each with a system prompt of its own (so no two rows
    are the same prompt, whose object the server would find instead of writing)."""
    pairs = json.loads(TEXTS.read_text())
    rng = random.Random(7)
    rows = []
    for i in range(count):
        pair = pairs[i % len(pairs)]
        system = f"You are assistant {i}; answer plainly. Seed {rng.randrange(10**6)}."
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": pair["question"]},
            {"role": "assistant", "content": pair["answer"]},
        ]
        rows.append({"custom_id": f"chat-{i:04d}", "messages": messages})
    return rows


@contextlib.asynccontextmanager
async def _server(model: Path, scratch: Path) -> AsyncIterator[str]:
    """hsx on the demo model in bfloat16 (eager: these rows time the export, not the
    engine), default layer ids, objects under ``scratch``; yields its URL."""
    from service.config import Settings
    from service.engine.extractor import Extractor

    settings = Settings(
        engine={
            "model": str(model),
            "dtype": "bfloat16",
            "max_model_len": 1024,
            "cpu_kvcache_space_gib": 1,
            "extra_args": {"enforce_eager": True},
        },
        storage={"url": str(scratch / "export-objects")},
        limits={"max_prompts": 64, "max_queued_prompts": 4096},
    )
    extractor = await Extractor.start(settings)
    try:
        server, task, url = await serve(settings, extractor)
        try:
            yield url
        finally:
            server.should_exit = True
            await task
    finally:
        await extractor.close()


async def _child(*args: str, log: Path) -> str:
    """``python -m ARGS`` from the repository; its output (raises on failure)."""
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", *args, cwd=REPO, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            # hsx refuses HSX_ variables that are not settings: the bench's own stay here.
            env={k: v for k, v in os.environ.items() if not k.startswith("HSX_BENCH_")},
        )  # fmt: skip
        status = await proc.wait()
    text = await asyncio.to_thread(log.read_text, errors="replace")
    if status != 0:
        raise RuntimeError(f"python -m {' '.join(args[:3])} failed ({status}):\n{text[-4000:]}")
    return text


async def _dataset_run(
    url: str, chats: list[dict[str, Any]], scratch: Path
) -> tuple[Path, dict[str, Any]]:
    source = scratch / "export-chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in chats))
    output = scratch / "export-run"
    await _child(
        "service", "dataset", "run", str(source), "--endpoint", url, "--output", str(output),
        "--loss", "assistant", "--codec", "raw", "--no-progress", log=scratch / "export-run.log",
    )  # fmt: skip
    summary: dict[str, Any] = json.loads((output / "summary.json").read_text())
    if summary["ok"] != len(chats):
        raise RuntimeError(f"the run stored {summary['ok']} of {len(chats)} chats: {summary}")
    return output, summary


async def _export(url: str, output: Path, model: Path, name: str, scratch: Path) -> dict[str, Any]:
    """One export of layout ``name``: its manifest (then the export is removed)."""
    dest = scratch / "export-dest"
    shutil.rmtree(dest, ignore_errors=True)
    await _child(
        "service", "dataset", "export", str(output), str(dest), *LAYOUTS[name],
        "--endpoint", url, "--model", str(model), log=scratch / "export.log",
    )  # fmt: skip
    manifest: dict[str, Any] = json.loads((dest / "hsx-export.json").read_text())
    if manifest["format"] == "speculators":  # its Arrow rows are part of what it writes
        manifest["bytes"] += sum(p.stat().st_size for p in dest.glob("data-*.arrow"))
    shutil.rmtree(dest)
    return manifest


async def _fetch_child(url: str, output: Path, scratch: Path) -> dict[str, Any]:
    text = await _child("benchmarks.export_bench", str(output), url, log=scratch / "fetch.log")
    return last_json(text)


async def fetch_all(output: str, url: str) -> dict[str, Any]:
    """Every ok object of the run fetched through the server, ``CONCURRENCY`` at a time:
    seconds, bytes and tokens (the child's work; timed after its imports)."""
    from service.client import AsyncHsxClient
    from service.dataset.manifest import load_records
    from service.dataset.store import RunStore
    from service.dataset.verify import run_stores

    root = RunStore(output)
    records = []
    for store, _job in await run_stores(root):
        records += [r for r in (await load_records(store)).values() if r.status == "ok"]
    await root.close()
    limit = asyncio.Semaphore(CONCURRENCY)
    started = time.monotonic()
    async with AsyncHsxClient(url, None, timeout=120) as client:

        async def one(key: str) -> int:
            async with limit:
                return len(await client.get_object(key))

        sizes = await asyncio.gather(*(one(r.key or "") for r in records))
    elapsed = time.monotonic() - started
    tokens = sum(r.num_tokens or 0 for r in records)
    return {"elapsed_s": elapsed, "bytes": sum(sizes), "tokens": tokens}


def _rows(
    summary: dict[str, Any],
    fetched: list[dict[str, Any]],
    exported: dict[str, list[dict[str, Any]]],
    chats: int,
) -> list[Row]:
    tokens = int(summary["tokens"])
    fetch_s = statistics.median(f["elapsed_s"] for f in fetched)
    fetch_mb = fetched[0]["bytes"] / 1e6
    what = f"{chats} chats, {tokens} tokens, SmolLM2 bf16"
    per_million = 1e6 / tokens
    raw_gb = int(summary["bytes"]) * per_million / 1e9
    rows = []
    for name, runs in exported.items():
        seconds = statistics.median(m["samples_s"] for m in runs)
        size = runs[0]["bytes"]
        rows.append(
            Row(
                name=f"trainer export, {name}: throughput ({what})",
                ours=f"{size / 1e6 / seconds:.1f} MB/s ({tokens / seconds:.0f} tok/s)",
                baseline=f"{fetch_mb / fetch_s:.1f} MB/s ({tokens / fetch_s:.0f} tok/s), "
                "objects fetched alone",
                ratio=fetch_s / seconds,
                target="info",
            )
        )
        rows.append(
            Row(
                name=f"trainer export, {name}: bytes per 1M tokens (SmolLM2 bf16, 4 layers held)",
                ours=f"{size * per_million / 1e9:.2f} GB",
                baseline=f"{raw_gb:.2f} GB, hsx's objects",
                ratio=size * per_million / 1e9 / raw_gb,
                target="info",
            )
        )
    return rows


if __name__ == "__main__":  # the fetch-alone child: OUTPUT URL
    print(json.dumps(asyncio.run(fetch_all(sys.argv[1], sys.argv[2]))))
