"""Engine benchmarks: what extraction costs beside the engine's own speed.

``python -m benchmarks.engine_bench [--quick]`` (also rows of ``make bench``). One
random-weight Llama and one set of prompts per length serve every side:

* the hsx engine, prompts through ``Extractor.extract`` (durable objects), against the
  same engine running the same prompts as plain ``generate`` calls with no hsx
  parameters (its connector saves nothing), in interleaved rounds;
* a vanilla vLLM ``AsyncLLM`` with the same engine arguments but no speculative method
  and no KV connector;
* the transformers pipeline of ``benchmarks.hf_pipeline``.

Only one engine fits on the machine at a time, so the engines run one after another;
the transformers rounds run beside the hsx engine's rounds while it is idle.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import random
import statistics
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.hf_pipeline import HfPipeline, LocalSink, S3Sink, Sink
from benchmarks.rss import MIB, PeakRss, children_rss
from benchmarks.storage_bench import Row, Timer
from service.config import Settings
from service.engine.tiny_models import make_model

Prompts = list[list[int]]
Medians = dict[str, float]  # median seconds of a prompt set, per side

MAX_BATCHED_TOKENS = 2048
#: What the engine processes may grow by beyond the in-flight ceiling: writer and
#: storage threads with their malloc arenas, encode buffers, ZMQ and Python objects.
RSS_MARGIN_MIB = 256
WARM_PROMPTS = 2  # per length and side, before any timed round


def _machine() -> str:
    """Cores, CPU model and memory of this machine, for the notes."""
    import psutil

    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else ())
        if line.startswith("model name")
    ]
    memory = psutil.virtual_memory().total / 1024**3
    return f"{os.cpu_count()} cores of {names[0] if names else 'an unknown CPU'}, {memory:.0f} GiB"


@dataclass(frozen=True)
class Plan:
    """The model, prompt sets and rounds of one bench mode."""

    hidden: int
    layers: int
    layer_ids: tuple[int, ...]
    sets: tuple[tuple[int, int], ...]  # (tokens per prompt, prompts)
    rounds: int
    in_flight_mib: int
    kv_cache_gib: float


FULL = Plan(1024, 8, (2, 4, 5, 8), ((256, 64), (2048, 8)), 3, 256, 2.0)
QUICK = Plan(128, 4, (1, 2, 4), ((256, 8), (2048, 2)), 2, 16, 1.0)

NOTES = f"""- **engine rows** ({_machine()}). Full mode: a random-weight Llama of
  hidden size {FULL.hidden}, {FULL.layers} layers (`service/engine/tiny_models.py`:
  intermediate 3072, 16 heads, 8 KV heads; about 100M parameters), float32,
  layer ids {list(FULL.layer_ids)}; {FULL.sets[0][1]} prompts of {FULL.sets[0][0]} tokens
  and {FULL.sets[1][1]} of {FULL.sets[1][0]} (the same token count), random token ids;
  `max_num_batched_tokens` {MAX_BATCHED_TOKENS}, prefix caching off (every round computes
  every prompt), a {FULL.kv_cache_gib:g} GiB KV cache, vLLM's default compilation.
  All prompts of a set go at once; throughput is prompt tokens over the wall time of the
  set, the median of {FULL.rounds} rounds after a two-prompt warm-up. `--quick` runs the
  tests' tiny model (hidden 128, 4 layers) with {QUICK.sets[0][1]}x{QUICK.sets[0][0]}
  and {QUICK.sets[1][1]}x{QUICK.sets[1][0]} prompts and {QUICK.rounds} rounds: it
  checks that the bench runs, its numbers mean little. Random weights give real shapes
  and real costs per token, not real activation statistics (which only codecs notice).
- **extraction vs same engine without extraction**: the hsx engine; `Extractor.extract`
  of every prompt (returns once the object is durable: fsync'd file or completed S3
  upload, SHA-256 computed) against plain `AsyncLLM.generate` of the same prompts with
  `max_tokens=1` and no hsx parameters on the same engine, alternating which goes first
  in each round. The ratio is throughput (extraction / plain); the target for local
  disk is at least 0.95. S3 is moto on 127.0.0.1 in the bench process: its CPU comes
  out of the same two cores, so the S3 rows are information.
- **extraction vs vanilla vLLM**: an `AsyncLLM` with the same engine arguments minus
  the speculative method, the KV connector and hsx's worker extension, plain requests,
  started after the hsx engines closed (one engine at a time fits here), so its rounds
  are not interleaved with the others. On this CPU build the vanilla engine has been
  slower than the connector-configured one on the same requests; that is vLLM's, not
  hsx's merit (information only).
- **extraction vs transformers**: `benchmarks/hf_pipeline.py`, a batched forward
  (`AutoModel`, `output_hidden_states`, `torch.inference_mode`, batches of about 4096
  tokens of equal-length prompts), the same layers stacked as `[tokens, layers,
  hidden]`, one safetensors file per prompt written by 4 threads while the next batch
  computes: fsync'd files on local disk, `put_object` to the same moto server for S3.
  Its last layer is after the final norm (transformers' convention) where hsx's is
  before it: the same shape and cost. Its rounds alternate with the hsx engine's while
  that engine is idle. Target at least 1.0 on local disk.
- **peak RSS growth**: the summed RSS of the hsx engine's processes (EngineCore and
  its worker), sampled every 50 ms through all local-disk extraction rounds, minus
  their RSS after warm-up requests without extraction. The bound is the in-flight
  ceiling (`limits.max_bytes_in_flight`, {FULL.in_flight_mib} MiB here: less than
  one round's {
    FULL.sets[1][1] * FULL.sets[1][0] * len(FULL.layer_ids) * FULL.hidden * 4 // MIB
} MiB of {FULL.sets[1][0]}-token states) plus a fixed {RSS_MARGIN_MIB} MiB
  for threads, their allocator arenas and buffers.
"""


def _prompts(length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(count)]


def _settings(plan: Plan, model: Path, storage: dict[str, Any]) -> Settings:
    longest = max(n for n, _ in plan.sets)
    return Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "layer_ids": list(plan.layer_ids),
            "max_model_len": longest + 16,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "cpu_kvcache_space_gib": plan.kv_cache_gib,
            "enable_prefix_caching": False,
            "extra_args": {"enforce_eager": True},
        },
        storage=storage,
        limits={"max_bytes_in_flight": plan.in_flight_mib * MIB, "max_queued_prompts": 4096},
    )


async def _nothing() -> None:
    return None


@dataclass
class Side:
    """One way of doing a set's work; ``clear`` (untimed) removes what it stored."""

    run: Callable[[Prompts], Awaitable[object]]
    clear: Callable[[], Awaitable[object]] = _nothing


async def _rounds(sides: dict[str, Side], prompts: Prompts, rounds: int, timer: Timer) -> Medians:
    """Median seconds per side over ``rounds`` rounds, the order rotating each round."""
    for side in sides.values():
        await side.run(prompts[:WARM_PROMPTS])
        await side.clear()
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            side = sides[name]
            times[name] += await timer(functools.partial(side.run, prompts), 1)
            await side.clear()
    return {name: statistics.median(t) for name, t in times.items()}


def _plain_side(engine: Any) -> Side:
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


def _extraction_side(extractor: Any) -> Side:
    """``Extractor.extract`` of every prompt; the objects are deleted between rounds."""
    keys: list[str] = []

    async def run(prompts: Prompts) -> None:
        done = await asyncio.gather(*(extractor.extract(p, namespace="bench") for p in prompts))
        keys.extend(r.key for r in done)

    async def clear() -> None:
        await asyncio.gather(*(extractor.storage.delete(k) for k in keys))
        keys.clear()

    return Side(run, clear)


def _hf_side(pipeline: HfPipeline, sink: Sink) -> Side:
    async def run(prompts: Prompts) -> None:
        await asyncio.to_thread(pipeline.run, prompts, sink)

    async def clear() -> None:
        await asyncio.to_thread(sink.clear)

    return Side(run, clear)


async def _hsx(
    settings: Settings, plan: Plan, sets: dict[int, Prompts], timer: Timer
) -> tuple[dict[int, Medians], int]:
    """Extraction and plain medians per prompt length, and the engine's RSS growth."""
    from service.engine.extractor import Extractor

    extractor = await Extractor.start(settings)
    try:
        plain = _plain_side(extractor.engine)
        for prompts in sets.values():  # every forward shape once before the RSS baseline
            await plain.run(prompts[:WARM_PROMPTS])
        before = children_rss()
        sides = {"extract": _extraction_side(extractor), "plain": plain}
        with PeakRss() as peak:
            medians = {n: await _rounds(sides, p, plan.rounds, timer) for n, p in sets.items()}
        return medians, peak.bytes - before
    finally:
        await extractor.close()


async def _vanilla(
    settings: Settings, plan: Plan, sets: dict[int, Prompts], timer: Timer
) -> dict[int, float]:
    """Plain medians per prompt length on an engine without hsx's parts."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from service.engine.builder import engine_args, read_model_info
    from service.engine.extractor import _release_vllm_resources

    info = read_model_info(str(settings.engine.model))
    hsx_args = engine_args(settings, info, list(plan.layer_ids), "ipc://unused")
    args = dataclasses.replace(
        hsx_args, speculative_config=None, kv_transfer_config=None, worker_extension_cls=""
    )
    engine = AsyncLLM.from_engine_args(args)
    try:
        side = {"plain": _plain_side(engine)}
        return {n: (await _rounds(side, p, plan.rounds, timer))["plain"] for n, p in sets.items()}
    finally:
        engine.shutdown()
        _release_vllm_resources(engine)


async def _transformers(
    model: Path, plan: Plan, sets: dict[int, Prompts], sinks: dict[str, Sink], timer: Timer
) -> dict[int, Medians]:
    """The transformers pipeline's medians per prompt length and sink."""
    pipeline = await asyncio.to_thread(HfPipeline, model, plan.layer_ids)
    sides = {name: _hf_side(pipeline, sink) for name, sink in sinks.items()}
    return {n: await _rounds(sides, p, plan.rounds, timer) for n, p in sets.items()}


def _moto(bucket: str) -> tuple[Any, str]:
    """A moto S3 server on 127.0.0.1 with ``bucket``; credentials from the environment."""
    # Imported here, as in storage_bench: vLLM's spawned processes re-import __main__.
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return server, endpoint


def _model(scratch: Path, plan: Plan) -> Path:
    out = scratch / f"engine-model-{plan.hidden}x{plan.layers}"
    if (out / "config.json").exists():
        return out
    longest = max(n for n, _ in plan.sets)
    return make_model(out, hidden_size=plan.hidden, num_layers=plan.layers, max_len=2 * longest)


async def run(scratch: Path, timed: Timer, quick: bool = False) -> list[Row]:
    """Extraction against the same engine, a vanilla engine and transformers; the
    engine's peak RSS growth. ``quick``: the tiny model and a few prompts."""
    plan = QUICK if quick else FULL
    model = await asyncio.to_thread(_model, scratch, plan)
    sets = {n: _prompts(n, count, seed=n) for n, count in plan.sets}
    bucket = "hsx-engine-bench"
    server, endpoint = _moto(bucket)
    try:
        s3 = {"endpoint_url": endpoint, "region": "us-east-1"}
        where: dict[str, dict[str, Any]] = {
            LOCAL: {"url": str(scratch / "engine-objects")},
            S3: {"url": f"s3://{bucket}/hsx", "s3": s3},
        }
        hsx, growth = {}, 0
        for name, storage in where.items():
            hsx[name], peak = await _hsx(_settings(plan, model, storage), plan, sets, timed)
            growth = peak if name == LOCAL else growth
        vanilla = await _vanilla(_settings(plan, model, where[LOCAL]), plan, sets, timed)
        sinks: dict[str, Sink] = {
            LOCAL: LocalSink(scratch / "hf-files"),
            S3: S3Sink(endpoint, bucket, threads=4),
        }
        hf = await _transformers(model, plan, sets, sinks, timed)
    finally:
        server.stop()
    rows = [row for name in where for row in _rows(plan, name, hsx[name], vanilla, hf)]
    return [*rows, _rss_row(plan, growth)]


LOCAL, S3 = "local disk", "S3 (moto)"


def _tok_s(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.0f} tok/s"


def _rows(
    plan: Plan,
    where: str,
    hsx: dict[int, Medians],
    vanilla: dict[int, float],
    hf: dict[int, Medians],
) -> list[Row]:
    """Three rows per prompt length: ratios are throughput, extraction over the other."""
    rows = []
    for n, count in plan.sets:
        tokens, ours = n * count, hsx[n]["extract"]
        local = where == LOCAL
        others = [
            ("same engine without extraction", hsx[n]["plain"], ">= 0.95" if local else "info"),
            ("vanilla vLLM (no spec. method, no connector)", vanilla[n], "info"),
            ("transformers pipeline", hf[n][where], ">= 1.0" if local else "info"),
        ]
        for what, seconds, target in others:
            name = f"extraction vs {what}, {count}x{n} tokens, {where} (ratio: throughput)"
            rows.append(
                Row(name, _tok_s(tokens, ours), _tok_s(tokens, seconds), seconds / ours, target)
            )
    return rows


def _rss_row(plan: Plan, growth: int) -> Row:
    bound = plan.in_flight_mib + RSS_MARGIN_MIB
    return Row(
        "peak RSS growth of the engine processes during local extraction vs in-flight "
        "ceiling + margin",
        f"{growth / MIB:.0f} MiB",
        f"{plan.in_flight_mib} + {RSS_MARGIN_MIB} MiB",
        growth / MIB / bound,
        "<= 1.0",
    )


def main() -> None:
    """``python -m benchmarks.engine_bench [--quick]``: print the rows."""
    import tempfile

    from benchmarks.run import timed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few prompts")
    quick = parser.parse_args().quick
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with tempfile.TemporaryDirectory(prefix="hsx-engine-bench-") as tmp:
        rows = asyncio.run(run(Path(tmp), timed, quick=quick))
    for row in rows:
        print(f"| {row.name} | {row.ours} | {row.baseline} | {row.ratio:.2f} | {row.target} |")


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
