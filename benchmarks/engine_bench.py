"""Engine benchmarks: what extraction costs beside the engine's own speed.

``python -m benchmarks.run --only engine_bench [--quick]``. One random-weight Llama and
one set of prompts per length serve every side:

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

import asyncio
import contextlib
import dataclasses
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Timer
from benchmarks.engine_sides import (
    WARM_PROMPTS,
    Medians,
    Prompts,
    Side,
    extraction_side,
    hf_side,
    plain_side,
    rounds,
)
from benchmarks.hf_pipeline import HfPipeline, LocalSink, S3Sink, Sink
from benchmarks.rss import MIB, PeakRss, children_rss
from service.config import Settings
from service.engine.tiny_models import make_model

MAX_BATCHED_TOKENS = 2048
#: What the engine processes may grow by beyond the in-flight ceiling: writer and
#: storage threads with their malloc arenas, encode buffers, ZMQ and Python objects.
RSS_MARGIN_MIB = 256
LOCAL, S3 = "local disk", "S3 (moto)"


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


def _round_mib(plan: Plan) -> int:
    """MiB of float32 states in one round of the longest prompts."""
    length, count = plan.sets[-1]
    return length * count * len(plan.layer_ids) * plan.hidden * 4 // MIB


FULL = Plan(1024, 8, (2, 4, 5, 8), ((256, 64), (2048, 8)), 3, 128, 2.0)
#: Every path once, small: two short prompt sets (the rows need two) and one round.
QUICK = Plan(128, 4, (1, 2, 4), ((64, 4), (256, 2)), 1, 16, 1.0)

_QUICK_ROUNDS = f"{QUICK.rounds} round{'s' if QUICK.rounds > 1 else ''}"
#: The start of every row this bench writes (``benchmarks.run --only`` replaces them).
ROW_PREFIXES = ("extraction vs ", "peak RSS growth")

NOTES = f"""- **engine rows**, on {_machine()} of memory. Full mode: a random-weight
  Llama of hidden size {FULL.hidden}, {FULL.layers} layers (intermediate 3072, 16 heads,
  8 KV heads: about 100M parameters; `service/engine/tiny_models.py`), float32, layer
  ids {list(FULL.layer_ids)}; {FULL.sets[0][1]} prompts of {FULL.sets[0][0]} tokens and
  {FULL.sets[1][1]} of {FULL.sets[1][0]} (the same token count), random token ids;
  `max_num_batched_tokens` {MAX_BATCHED_TOKENS}, prefix caching off (every round computes
  every prompt), a {FULL.kv_cache_gib:g} GiB KV cache, eager mode on every vLLM engine
  (vLLM's CPU default compiles with inductor: about 5 minutes per engine start here, for
  throughput within this machine's noise). All prompts of a set go at once; throughput
  is prompt tokens over the set's wall time, the median of {FULL.rounds} rounds after a
  two-prompt warm-up. The ratio is always extraction's throughput over the other side's.
  `--quick` runs the tests' tiny model (hidden 128, 4 layers) on
  {QUICK.sets[0][1]}x{QUICK.sets[0][0]} and {QUICK.sets[1][1]}x{QUICK.sets[1][0]}
  prompts, {_QUICK_ROUNDS}: it shows that the bench runs; its numbers mean little.
  Random weights give real shapes and real costs per token, not real activation
  statistics (which only the codecs would notice).
- **extraction vs same engine without extraction**: one hsx engine; `Extractor.extract`
  of every prompt (answers once the object is durable: SHA-256 computed, file and
  directory fsync'd, or the S3 upload complete) against `AsyncLLM.generate` of the
  same prompts with `max_tokens=1` and no hsx parameters (the connector saves nothing),
  the order alternating each round. Target for local disk: at least 0.95. S3 is moto
  on 127.0.0.1 inside the bench process, so its CPU comes out of the same cores as the
  engine's: the S3 rows are information.
- **What stands between extraction and 0.95 at 256 tokens on local disk**: the spread
  between runs (two full runs of the same code on one day read 0.98 and 0.94; single
  rounds spread about ±0.05 more). What extraction costs the worker, what was cut and
  what was tried: `docs/profile.md`.
- **extraction vs vanilla vLLM**: an `AsyncLLM` with the same engine arguments minus
  the speculative method, the KV connector and hsx's worker extension; plain requests.
  Only one engine fits on this machine at a time, so it runs after the hsx engines
  closed and its rounds are not interleaved with theirs. vLLM's CPU backend keeps cores
  back from the worker: one for the scheduler process, and one more when a KV connector
  is configured, but none when that would leave the worker nothing
  (`vllm/utils/ompmultiprocessing.py`). On 2 cores an hsx engine's worker therefore
  computes on both cores and a default vanilla engine's on one (core ids in vLLM's
  start-up log), which is why vanilla looked about 1.8x slower than hsx's plain
  requests when issue 13 was filed. The bench starts the vanilla engine with hsx's
  reservation (`VLLM_CPU_NUM_OF_RESERVED_CPU=2`), so both workers get the same cores.
  On larger machines an hsx engine's worker gets one core fewer than a default vanilla
  engine's: a cost of configuring any KV connector on vLLM's CPU backend, which this
  row leaves out. Information only.
- **extraction vs transformers**: `benchmarks/hf_pipeline.py`, a batched forward
  (`AutoModel`, `output_hidden_states`, `torch.inference_mode`, torch's default
  threads, batches of about 4096 tokens of equal-length prompts), the same layers
  stacked as `[tokens, layers, hidden]`, one safetensors file per prompt written by 4
  threads while the next batch computes: each file fsync'd on local disk, or
  `put_object` to the same moto server. Its rounds take turns with those of the hsx
  engine of the same storage while that engine idles (an idle engine used about 1% of
  a core here). Its last layer is taken after the final norm (transformers'
  convention) where hsx's is before it: the same shape and cost. Target for local
  disk: at least 1.0.
- **peak RSS growth**: the summed RSS of the hsx engine's processes (EngineCore and
  its worker), sampled every 50 ms through every local-disk round, minus their RSS
  after warm-up requests without extraction at both lengths. The bound is the in-flight
  ceiling (`limits.max_bytes_in_flight`, lowered from 1 GiB to {FULL.in_flight_mib} MiB
  in full mode, half of one round's {_round_mib(FULL)} MiB of {FULL.sets[1][0]}-token
  states, so that it binds) plus a fixed {RSS_MARGIN_MIB} MiB for the writer's threads
  and buffers. Target: growth at most that bound. What decides it is the allocator,
  not the ceiling (the full bench's first run gave 502 MiB against 384 with glibc's
  dynamic thresholds): the CPU worker keeps a steady heap and the writer trims it
  (`service/engine/allocator.py`; `docs/profile.md`, "The heap"). The table's rows ran
  with the steady heap on both sides of the same-engine row.
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


async def _hsx(
    settings: Settings, plan: Plan, sets: dict[int, Prompts], timer: Timer, transformers: Side
) -> tuple[dict[int, Medians], int]:
    """Medians per prompt length of extraction, plain requests and ``transformers``
    (its rounds run between the engine's, while the engine idles), and the engine's
    RSS growth."""
    from service.engine.extractor import Extractor

    extractor = await Extractor.start(settings)
    try:
        plain = plain_side(extractor.engine)
        for prompts in sets.values():  # every forward shape once before the RSS baseline
            await plain.run(prompts[:WARM_PROMPTS])
        before = children_rss()
        sides = {"extract": extraction_side(extractor), "plain": plain, "hf": transformers}
        with PeakRss() as peak:
            medians = {n: await rounds(sides, p, plan.rounds, timer) for n, p in sets.items()}
        return medians, max(peak.bytes - before, 0)
    finally:
        await extractor.close()


#: What vLLM's CPU backend keeps back from the worker of a one-worker engine with a KV
#: connector: a core for the scheduler process and one "for nixl".
CONNECTOR_RESERVED_CPUS = 2


@contextlib.contextmanager
def _hsx_core_reservation() -> Iterator[None]:
    """Start the vanilla engine with the cores an hsx engine's worker gets.

    vLLM's CPU backend keeps cores back from the worker: one per worker, one more when
    a KV connector is configured, and none when that would leave the worker nothing
    (``vllm/utils/ompmultiprocessing.py``; ``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides).
    On two cores an hsx engine's worker thus computes on both and a default vanilla
    engine's on one: a comparison of core counts, not of engines. Its processes are
    spawned during start-up, so the variable is set only for that time.
    """
    name = "VLLM_CPU_NUM_OF_RESERVED_CPU"
    if name in os.environ:  # the user's choice holds for both engines
        yield
        return
    os.environ[name] = str(CONNECTOR_RESERVED_CPUS)
    try:
        yield
    finally:
        del os.environ[name]


async def _vanilla(
    settings: Settings, plan: Plan, sets: dict[int, Prompts], timer: Timer
) -> dict[int, float]:
    """Plain medians per prompt length on an engine without hsx's parts."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from service.engine.builder import engine_args, read_model_info

    info = read_model_info(str(settings.engine.model))
    hsx_args = engine_args(settings, info, list(plan.layer_ids), "ipc://unused")
    args = dataclasses.replace(
        hsx_args, speculative_config=None, kv_transfer_config=None, worker_extension_cls=""
    )
    with _hsx_core_reservation():
        engine = AsyncLLM.from_engine_args(args)
    try:
        side = {"plain": plain_side(engine)}
        return {n: (await rounds(side, p, plan.rounds, timer))["plain"] for n, p in sets.items()}
    finally:
        # vLLM's own shutdown: what it leaves open in this process (a ZMQ context, the
        # EngineCore's process objects) is idle and does not touch the timed rounds.
        engine.shutdown()


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
        pipeline = await asyncio.to_thread(HfPipeline, model, plan.layer_ids)
        sinks: dict[str, Sink] = {
            LOCAL: LocalSink(scratch / "hf-files"),
            S3: S3Sink(endpoint, bucket, threads=4),
        }
        hsx, growth = {}, {}
        for name, storage in where.items():
            settings = _settings(plan, model, storage)
            transformers = hf_side(pipeline, sinks[name])
            hsx[name], growth[name] = await _hsx(settings, plan, sets, timed, transformers)
        vanilla = await _vanilla(_settings(plan, model, where[LOCAL]), plan, sets, timed)
    finally:
        server.stop()
    rows = [row for name in where for row in _rows(plan, name, hsx[name], vanilla)]
    return [*rows, _rss_row(plan, growth[LOCAL])]


def _tok_s(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.0f} tok/s"


def _rows(
    plan: Plan,
    where: str,
    hsx: dict[int, Medians],
    vanilla: dict[int, float],
) -> list[Row]:
    """Three rows per prompt length: ratios are throughput, extraction over the other."""
    rows = []
    for n, count in plan.sets:
        tokens, ours = n * count, hsx[n]["extract"]
        local = where == LOCAL
        others = [
            ("same engine without extraction", hsx[n]["plain"], ">= 0.95" if local else "info"),
            ("vanilla vLLM (no spec. method, no connector)", vanilla[n], "info"),
            ("transformers pipeline", hsx[n]["hf"], ">= 1.0" if local else "info"),
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
