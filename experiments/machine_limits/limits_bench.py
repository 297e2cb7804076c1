"""Limit rows (issue 31): how far hsx is from what this machine can do, and cost growth.

``python -m experiments.machine_limits.limits_bench [--quick]`` prints the rows (an
experiment: ``make bench`` does not run it; ``README.md`` beside this file). In order,
with no two engines alive at once:

1. the disk's durable-write bandwidth (``machine_limits.durable_write_mb_s``);
2. an hsx engine with vLLM's default CPU binding: which cores its worker was given and
   how many it used; extraction, plain requests on the same engine and the transformers
   pipeline on the same prompts (``engine_sides.rounds``), for MFU and the disk rows;
   then the cost-growth rounds, prompt lengths from 128 tokens up, the same token
   count a round, each length with the worker's peak RSS per side;
3. the GEMM peak (``torch.mm`` or vLLM's oneDNN GEMM, the better) at the worker's
   thread count and at all cores, with no engine alive
   (``machine_limits.matmul_peak_gflops``);
4. one fresh engine per binding setting (``VLLM_CPU_OMP_THREADS_BIND``, ...), set in
   the environment before it starts (its processes inherit it), extraction rounds only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import Row, Timer, fresh_prompts
from benchmarks.engine_sides import Prompts, Side, extraction_side, hf_side, plain_side, rounds
from benchmarks.hf_pipeline import HfPipeline, LocalSink
from benchmarks.rss import MIB, PeakRss
from experiments.common import print_rows
from experiments.machine_limits.machine_limits import (
    durable_write_mb_s,
    flops_per_token,
    matmul_parameters,
    matmul_peak_gflops,
)
from service.config import Settings

BIND = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
MAX_BATCHED_TOKENS = 2048
#: Every row's name starts with it: ``run.py --only limits_bench`` replaces these rows.
ROW_PREFIXES = ("limits: ",)
#: The binding rows, each a fresh engine: one core (what a default engine without a KV
#: connector gets on 2 cores, as issue 31's vanilla engine did), no binding at all, the
#: default's two cores named explicitly, and the default again (``auto``): the last two
#: show how much two starts of the same engine differ.
FULL_BINDINGS: tuple[dict[str, str], ...] = (
    {BIND: "0"},
    {BIND: "nobind"},
    {BIND: "0-1"},
    {BIND: "auto"},
)


@dataclass(frozen=True)
class Plan:
    """The model, prompt sets, rounds and sizes of one bench mode."""

    hidden: int
    layers: int
    layer_ids: tuple[int, ...]
    mfu_set: tuple[int, int]  # (tokens per prompt, prompts)
    rounds: int
    lengths: tuple[int, ...]  # cost growth: tokens per prompt
    growth_tokens: int  # prompt tokens per cost-growth round, at every length
    growth_rounds: int
    bindings: tuple[dict[str, str], ...]
    matmul_sizes: tuple[int, ...]
    disk_mib: int


FULL = Plan(
    512,
    4,
    (1, 2, 3, 4),
    (256, 64),
    3,
    (128, 1024, 4096, 16384),
    16384,
    3,
    FULL_BINDINGS,
    (1024, 2048, 3072),
    1024,
)
#: Every path once, small: two lengths, one binding, one round.
QUICK = Plan(
    512, 4, (1, 2, 3, 4), (128, 8), 1, (128, 1024), 2048, 1, ({BIND: "0"},), (512, 1024), 64
)

NOTES = f"""- **limit rows (issue 31)**, `experiments/machine_limits/limits_bench.py` with
  `machine_limits.py`. Model: the random-weight Llama of `bench_settings` at
  hidden {FULL.hidden} ({FULL.layers} layers, intermediate {3 * FULL.hidden}, 8 heads of
  64, 4 KV heads, vocabulary 512), float32, layer ids {list(FULL.layer_ids)}, eager
  mode, prefix caching off, `max_num_batched_tokens` {MAX_BATCHED_TOKENS} (longer
  prompts prefill in chunks), `max_model_len` {max(FULL.lengths) + 16}, local disk.
  One engine alive at a time; nothing else of this bench computes while an engine
  does, but the machine may be shared: the "other processes' CPU" rows say how much
  else ran (system-wide busy CPU from `/proc/stat` minus this bench's process tree).
- **matmul peak**: square float32 GEMMs of {list(FULL.matmul_sizes)}, by `torch.mm`
  and by vLLM's oneDNN GEMM with its weight prepacked (the kernel vLLM's CPU linear
  layers run; on the AMD host of 2026-11-28 it reached twice `torch.mm`'s rate, so a
  `torch.mm` peak put MFU above 100%; rows measured before then used `torch.mm`
  alone), median of 5 calls each after one untimed, the best size and kernel; at the
  thread count vLLM gave the engine's worker (one OpenMP thread per bound CPU) and at
  all cores; measured
  with no engine alive, before the engines and after the first, the better of the two.
- **FLOPs per prompt token**: `machine_limits.flops_per_token`: 2 x the matmul weights
  (Q, K, V, O, gate, up, down of every layer) plus attention's QK^T and AV at the
  prompts' mean causal context ((n + 1) / 2 for n-token prompts). Not counted: the
  elementwise ops, the embedding lookup, and the LM head, which the extraction engine
  runs once per prompt (one output token), not per token, and the transformers
  pipeline not at all. SmolLM2-135M (the demo model, `service.demo_model.prepare`) is
  counted from its config for comparison; its MFU is not measured here.
- **MFU**: prompt tokens per second (the median of {FULL.rounds} rounds of
  {FULL.mfu_set[1]} prompts of {FULL.mfu_set[0]} tokens, all at once, sides rotating
  each round, `engine_sides.rounds`) x FLOPs per token / the matmul peak at the thread
  count the side computes on (the engine worker's, or torch's in the bench process for
  transformers). Sides: `Extractor.extract` (durable objects), plain `generate` on the
  same engine (nothing saved), `benchmarks/hf_pipeline.py` (its rounds run while the
  engine idles).
- **disk**: `durable_write_mb_s`: a {FULL.disk_mib} MiB file in 8 MiB writes of random
  bytes, file and directory fsync'd, median of 3 (MB = 10^6 bytes). Extraction's rate:
  its measured throughput x the stored object bytes per token (one object's `size` /
  `num_tokens`, header and token ids included). The ratio is the share of the disk's
  bandwidth extraction needs.
- **cores**: the CPU list vLLM binds the worker's OpenMP threads to, computed by
  vLLM's own `OMPProcessManager` from the engine's config under the same environment
  (what its "OpenMP thread binding info" log line prints); the worker's threads counted
  by the CPUs each may run on (`/proc/PID/task/*/status`); and the cores it used: its
  CPU seconds over the wall time of the extraction rounds (EngineCore's likewise).
  Each binding row is a fresh engine started with that variable in its environment,
  extraction rounds only, against the default engine's extraction rounds (not
  interleaved: they are different engines).
- **cost growth**: prompt lengths {list(FULL.lengths)}, {FULL.growth_tokens} prompt
  tokens a round at every length (so {FULL.growth_tokens // FULL.lengths[-1]} prompt of
  {FULL.lengths[-1]} and {FULL.growth_tokens // FULL.lengths[0]} of {FULL.lengths[0]}),
  extraction against plain requests on the same engine, median of {FULL.growth_rounds}
  rounds, fresh random prompts; the worker's peak RSS (sampled every 50 ms) during each
  side's runs. The RSS of a side includes what earlier runs left resident, so only a
  difference that grows with length means something. `--quick` runs 2 lengths, small
  matmuls, one binding, one round: it shows that the bench runs.
"""


# --- the machine and the engine's processes --------------------------------------


def _own_cpu() -> float:
    """CPU seconds of this process and its live descendants."""
    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def _busy_cpu() -> float:
    """CPU seconds the whole machine has been busy since boot."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


@dataclass
class OtherLoad:
    """Cores that processes outside this bench kept busy, per phase."""

    cores: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Record the other processes' mean busy cores while the block runs."""
        busy, own, start = _busy_cpu(), _own_cpu(), time.perf_counter()
        try:
            yield
        finally:
            other = (_busy_cpu() - busy) - (_own_cpu() - own)
            self.cores[phase] = max(other, 0.0) / (time.perf_counter() - start)


def _allowed(status: Path) -> str:
    """A thread's ``Cpus_allowed_list`` from its ``/proc`` status file."""
    for line in status.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _vllm_cores(engine: Any) -> list[list[int]] | None:
    """The CPU list vLLM binds each worker's OpenMP threads to, computed by vLLM's own
    ``OMPProcessManager`` from the engine's config and this process's environment (call
    it where the engine's environment is set); None when it binds nothing (``nobind``).
    The same object makes the worker's binding at spawn and logs it ("OpenMP thread
    binding info")."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(engine.vllm_config)
    return None if manager.skip_setup else [list(cpus) for cpus in manager.cpu_lists]


def _title(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{proc.name()} {' '.join(proc.cmdline())}"
    return ""


@dataclass
class EngineProcesses:
    """The engine's scheduler process (EngineCore) and its one worker."""

    core: psutil.Process | None
    worker: psutil.Process

    @classmethod
    def find(cls) -> EngineProcesses:
        """The processes by the titles vLLM gives them (``VLLM::EngineCore...``,
        ``VLLM::Worker...``); the worker is the EngineCore's child otherwise."""
        children = psutil.Process().children(recursive=True)
        core = next((p for p in children if "EngineCore" in _title(p)), None)
        worker = next((p for p in children if "Worker" in _title(p)), None)
        if worker is None and core is not None:
            worker = max(core.children(), key=lambda p: p.memory_info().rss)
        if worker is None:
            raise RuntimeError("no engine worker process found")
        return cls(core, worker)

    def pins(self) -> str:
        """The worker's threads by the CPUs each may run on (``/proc``'s
        ``Cpus_allowed_list``), main thread first, e.g. ``main 0; 0: 1, 1: 9, 0-1: 30``:
        vLLM pins each OpenMP thread to one CPU of its list; hsx's writer threads are
        pinned to the CPUs the main thread is not on."""
        counts: Counter[str] = Counter()
        main = ""
        for task in Path(f"/proc/{self.worker.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                cpus = _allowed(task / "status")
                counts[cpus] += 1
                main = cpus if task.name == str(self.worker.pid) else main
        return f"main thread {main}; " + ", ".join(f"{c}: {n}" for c, n in counts.items())

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the worker and of the EngineCore process."""

        def seconds(proc: psutil.Process | None) -> float:
            if proc is None:
                return 0.0
            times = proc.cpu_times()
            return float(times.user + times.system)

        return seconds(self.worker), seconds(self.core)


class _ProcessPeak(PeakRss):
    """:class:`PeakRss` of one process (the worker) rather than all children."""

    def __init__(self, proc: psutil.Process) -> None:
        super().__init__()
        self._proc = proc

    def __enter__(self) -> _ProcessPeak:
        self._children = [self._proc]
        self._thread.start()
        return self


@dataclass
class Usage:
    """What a side's runs cost the engine: wall and CPU seconds, the worker's peak RSS."""

    wall: float = 0.0
    worker_cpu: float = 0.0
    core_cpu: float = 0.0
    peak_rss: int = 0

    def cores(self) -> tuple[float, float]:
        """Mean busy cores of the worker and of the EngineCore process."""
        wall = self.wall or 1.0
        return self.worker_cpu / wall, self.core_cpu / wall


def _observed(side: Side, engine: EngineProcesses, usage: Usage) -> Side:
    """``side`` with its engine CPU, wall time and worker peak RSS added to ``usage``."""

    async def run(prompts: Prompts) -> None:
        before, start = engine.cpu(), time.perf_counter()
        with _ProcessPeak(engine.worker) as peak:
            await side.run(prompts)
        after = engine.cpu()
        usage.wall += time.perf_counter() - start
        usage.worker_cpu += after[0] - before[0]
        usage.core_cpu += after[1] - before[1]
        usage.peak_rss = max(usage.peak_rss, peak.bytes)

    return Side(run, side.clear)


# --- engines ---------------------------------------------------------------------


def _model(scratch: Path, plan: Plan) -> Path:
    """The random Llama of ``bench_settings`` at ``plan.hidden``, its positions long
    enough for the longest prompt (``bench_settings`` makes 2048)."""
    from service.engine.tiny_models import make_model

    out = scratch / f"limits-model-{plan.hidden}x{plan.layers}"
    if (out / "config.json").exists():
        return out
    longest = max(plan.lengths)
    return make_model(out, hidden_size=plan.hidden, num_layers=plan.layers, max_len=2 * longest)


def _settings(plan: Plan, model: Path, scratch: Path) -> Settings:
    longest = max(max(plan.lengths), plan.mfu_set[0])
    return Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "layer_ids": list(plan.layer_ids),
            "max_model_len": longest + 16,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "cpu_kvcache_space_gib": 1,
            "enable_prefix_caching": False,
            "extra_args": {"enforce_eager": True},
        },
        storage={"url": str(scratch / "limits-objects")},
        limits={"max_queued_prompts": 4096},
    )


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set inside the block, the previous values after (the engine's processes
    are spawned while it starts, and inherit what is set then)."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class Started:
    """A running hsx engine, its processes and the binding vLLM gave its worker."""

    extractor: Any
    processes: EngineProcesses
    cores: list[list[int]] | None

    def binding(self) -> str:
        """vLLM's CPU list(s) for the worker and the worker threads' observed pins."""
        given = "no binding" if self.cores is None else f"cores {self.cores}"
        return f"vLLM gave the worker {given} ({self.processes.pins()})"

    def threads(self) -> int:
        """The worker's OpenMP threads: one per bound CPU, else torch's default."""
        return len(self.cores[0]) if self.cores else (os.cpu_count() or 1)


@contextlib.asynccontextmanager
async def _engine(settings: Settings, env: dict[str, str]) -> AsyncIterator[Started]:
    """An hsx ``Extractor`` started with ``env``; closed on exit."""
    from service.engine.extractor import Extractor

    with _environment(env):
        extractor = await Extractor.start(settings)
        cores = _vllm_cores(extractor.engine)
    try:
        yield Started(extractor, EngineProcesses.find(), cores)
    finally:
        await extractor.close()


async def _bytes_per_token(extractor: Any, length: int) -> float:
    """Stored object bytes per prompt token of one ``length``-token prompt (untimed)."""
    (prompt,) = fresh_prompts([length], seed=length, salt="size")
    result = await extractor.extract(prompt, extractor.request_params("limits"))
    await extractor.storage.delete(result.key)
    return float(result.size / result.num_tokens)


# --- measurements ----------------------------------------------------------------


@dataclass
class Measured:
    """Seconds per round (median) and usage of each side, keyed by side name."""

    seconds: dict[str, float]
    usage: dict[str, Usage]


async def _measure(
    sides: dict[str, Side], engine: EngineProcesses, prompts: Prompts, count: int, timer: Timer
) -> Measured:
    """``rounds`` of ``sides`` (those named ``hf`` unobserved: they run while the
    engine idles), with each engine side's usage."""
    usage = {name: Usage() for name in sides if name != "hf"}
    observed = {
        name: _observed(side, engine, usage[name]) if name in usage else side
        for name, side in sides.items()
    }
    return Measured(await rounds(observed, prompts, count, timer), usage)


@dataclass
class DefaultEngine:
    """What the engine with vLLM's default binding gave."""

    binding: str
    threads: int
    mfu: Measured
    bytes_per_token: float
    growth: dict[int, Measured]


async def _default_engine(
    plan: Plan, scratch: Path, model: Path, timer: Timer, load: OtherLoad
) -> DefaultEngine:
    """Binding, MFU rounds (three sides), bytes per token and cost growth on one
    engine with vLLM's default binding."""
    length, count = plan.mfu_set
    settings = _settings(plan, model, scratch)
    pipeline = await asyncio.to_thread(HfPipeline, model, plan.layer_ids)
    sink = LocalSink(scratch / "limits-hf-files")
    async with _engine(settings, {}) as started:
        extractor, engine = started.extractor, started.processes
        sides = {
            "extract": extraction_side(extractor),
            "plain": plain_side(extractor.engine),
            "hf": hf_side(pipeline, sink),
        }
        prompts = fresh_prompts([length] * count, seed=1, salt="mfu")
        with load.during("MFU rounds"):
            mfu = await _measure(sides, engine, prompts, plan.rounds, timer)
        per_token = await _bytes_per_token(extractor, length)
        with load.during("cost-growth rounds"):
            growth = await _growth(plan, extractor, engine, timer)
        return DefaultEngine(started.binding(), started.threads(), mfu, per_token, growth)


async def _growth(
    plan: Plan, extractor: Any, engine: EngineProcesses, timer: Timer
) -> dict[int, Measured]:
    """Extraction and plain requests at every length, ``plan.growth_tokens`` a round."""
    sides = {"extract": extraction_side(extractor), "plain": plain_side(extractor.engine)}
    out = {}
    for n in plan.lengths:
        count = max(plan.growth_tokens // n, 1)
        prompts = fresh_prompts([n] * count, seed=n, salt="growth")
        out[n] = await _measure(sides, engine, prompts, plan.growth_rounds, timer)
    return out


@dataclass
class Binding:
    """Extraction on a fresh engine started with ``env``."""

    env: dict[str, str]
    binding: str
    extract: Measured


async def _binding(plan: Plan, settings: Settings, env: dict[str, str], timer: Timer) -> Binding:
    length, count = plan.mfu_set
    async with _engine(settings, env) as started:
        extractor, engine = started.extractor, started.processes
        prompts = fresh_prompts([length] * count, seed=2, salt=f"bind-{env}")
        sides = {"extract": extraction_side(extractor)}
        measured = await _measure(sides, engine, prompts, plan.rounds, timer)
        return Binding(env, started.binding(), measured)


@dataclass
class Peaks:
    """Matmul peaks in GFLOP/s at the engine's thread count, at all cores, and at
    torch's own thread count in this process (the transformers pipeline's)."""

    engine: float
    all_cores: float
    torch: float
    threads: dict[str, int]


def _thread_counts(engine_threads: int | None) -> dict[str, int]:
    """The thread counts a peak is wanted at; the engine's once it is known."""
    import torch

    counts = {"all_cores": os.cpu_count() or 1, "torch": torch.get_num_threads()}
    return counts if engine_threads is None else {"engine": engine_threads, **counts}


def _matmul(plan: Plan, counts: dict[str, int], earlier: dict[int, float]) -> dict[int, float]:
    """The matmul peak at each of ``counts``' thread counts, the better of this
    measurement and an ``earlier`` one: a peak is the best the machine showed, and on a
    shared machine one measurement may fall in another process's busy moment."""
    import torch

    out = dict(earlier)
    for threads in sorted(set(counts.values())):
        peak = matmul_peak_gflops(torch.float32, threads, sizes=plan.matmul_sizes)
        out[threads] = max(peak, earlier.get(threads, 0.0))
    return out


def _peaks(plan: Plan, engine_threads: int, earlier: dict[int, float]) -> Peaks:
    counts = _thread_counts(engine_threads)
    measured = _matmul(plan, counts, earlier)
    return Peaks(
        measured[counts["engine"]], measured[counts["all_cores"]], measured[counts["torch"]], counts
    )


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """The limit rows: matmul peak, FLOPs per token, MFU of each side, disk bandwidth
    against extraction's write rate, the forward pass's cores and binding settings,
    and cost growth with prompt length. ``quick``: small sizes, two lengths."""
    from service import demo_model

    plan = QUICK if quick else FULL
    load = OtherLoad()
    model = await asyncio.to_thread(_model, scratch, plan)
    demo = await asyncio.to_thread(demo_model.prepare)
    settings = _settings(plan, model, scratch)
    with load.during("disk"):
        disk = await asyncio.to_thread(durable_write_mb_s, scratch / "disk", plan.disk_mib)
    with load.during("matmul, before the engines"):
        early = await asyncio.to_thread(_matmul, plan, _thread_counts(None), {})
    default = await _default_engine(plan, scratch, model, timer, load)
    with load.during("matmul, after the default engine"):
        peaks = await asyncio.to_thread(_peaks, plan, default.threads, early)
    bindings = []
    for env in plan.bindings:
        with load.during("the engine with " + ", ".join(f"{k}={v}" for k, v in env.items())):
            bindings.append(await _binding(plan, settings, env, timer))
    models = {f"random Llama hidden {plan.hidden}": model, "SmolLM2-135M": demo}
    rows = [
        *_peak_rows(peaks),
        *_flop_rows(models, plan.mfu_set[0]),
        *_mfu_rows(plan, model, default, peaks),
        _disk_row(plan, default, disk),
        *_core_rows(plan, default, bindings),
        *_growth_rows(plan, default.growth),
        *_load_rows(load),
    ]
    return [dataclasses.replace(row, name=ROW_PREFIXES[0] + row.name) for row in rows]


# --- rows ------------------------------------------------------------------------


def _context(length: int) -> int:
    """Mean causal context of an ``length``-token prompt's tokens."""
    return (length + 1) // 2


def _tok_s(tokens: int, seconds: float) -> float:
    return tokens / seconds


def _peak_rows(peaks: Peaks) -> list[Row]:
    engine, cores = peaks.threads["engine"], peaks.threads["all_cores"]
    return [
        Row(
            f"matmul peak, float32 GEMM: {engine} thread(s) (the engine worker's) vs "
            f"all {cores} cores",
            f"{peaks.engine:.0f} GFLOP/s",
            f"{peaks.all_cores:.0f} GFLOP/s",
            peaks.engine / peaks.all_cores,
            "info",
        )
    ]


def _flop_rows(models: dict[str, Path], length: int) -> list[Row]:
    rows = []
    for name, path in models.items():
        total = flops_per_token(path, _context(length))
        matmul = 2 * matmul_parameters(path)
        rows.append(
            Row(
                f"FLOPs per prompt token, {name} at mean context {_context(length)} "
                f"({length}-token prompts) vs its matmul weights alone",
                f"{total / 1e6:.1f} MFLOP",
                f"{matmul / 1e6:.1f} MFLOP (2 x {matmul / 2e6:.1f}M weights)",
                total / matmul,
                "info",
            )
        )
    return rows


def _mfu_rows(plan: Plan, model: Path, default: DefaultEngine, peaks: Peaks) -> list[Row]:
    length, count = plan.mfu_set
    per_token = flops_per_token(model, _context(length))
    sides = {
        "hsx without extraction": ("plain", peaks.engine, peaks.threads["engine"]),
        "hsx with extraction": ("extract", peaks.engine, peaks.threads["engine"]),
        "transformers pipeline": ("hf", peaks.torch, peaks.threads["torch"]),
    }
    rows = []
    for name, (side, peak, threads) in sides.items():
        tok_s = _tok_s(length * count, default.mfu.seconds[side])
        achieved = tok_s * per_token / 1e9
        rows.append(
            Row(
                f"MFU, {name}, {count}x{length} tokens: achieved vs matmul peak at "
                f"{threads} thread(s)",
                f"{achieved:.1f} GFLOP/s ({tok_s:.0f} tok/s x {per_token / 1e6:.1f} MFLOP)",
                f"{peak:.0f} GFLOP/s",
                achieved / peak,
                "info",
            )
        )
    return rows


def _disk_row(plan: Plan, default: DefaultEngine, disk_mb_s: float) -> Row:
    length, count = plan.mfu_set
    tok_s = _tok_s(length * count, default.mfu.seconds["extract"])
    write = tok_s * default.bytes_per_token / 1e6
    return Row(
        f"extraction's write rate ({count}x{length} tokens, {default.bytes_per_token:.0f} B "
        "per token) vs the disk's durable-write bandwidth (fsync'd)",
        f"{write:.1f} MB/s",
        f"{disk_mb_s:.0f} MB/s",
        write / disk_mb_s,
        "info",
    )


def _cores_text(usage: Usage) -> str:
    worker, core = usage.cores()
    return f"worker {worker:.2f} cores, EngineCore {core:.2f}"


def _core_rows(plan: Plan, default: DefaultEngine, bindings: list[Binding]) -> list[Row]:
    length, count = plan.mfu_set
    tokens = length * count
    cpus = os.cpu_count() or 1
    usage = default.mfu.usage["extract"]
    rows = [
        Row(
            "cores of the forward pass, default binding (VLLM_CPU_OMP_THREADS_BIND=auto): "
            "worker's OpenMP setting, cores busy during extraction vs cores",
            f"{default.binding}; {_cores_text(usage)}",
            f"{cpus} cores",
            usage.cores()[0] / cpus,
            "info",
        )
    ]
    base = default.mfu.seconds["extract"]
    for bound in bindings:
        env = ", ".join(f"{k}={v}" for k, v in bound.env.items())
        seconds = bound.extract.seconds["extract"]
        rows.append(
            Row(
                f"extraction throughput, {count}x{length} tokens, fresh engine with {env} "
                "vs the default binding",
                f"{_tok_s(tokens, seconds):.0f} tok/s ({bound.binding}; "
                f"{_cores_text(bound.extract.usage['extract'])})",
                f"{_tok_s(tokens, base):.0f} tok/s",
                base / seconds,
                "info",
            )
        )
    return rows


def _growth_rows(plan: Plan, growth: dict[int, Measured]) -> list[Row]:
    rows = []
    for n, measured in growth.items():
        count = max(plan.growth_tokens // n, 1)
        ext, plain = measured.seconds["extract"], measured.seconds["plain"]
        rss = {side: measured.usage[side].peak_rss / MIB for side in ("extract", "plain")}
        rows += [
            Row(
                f"cost growth, {count}x{n} tokens: extraction vs same engine without "
                "(ratio: throughput)",
                f"{_tok_s(count * n, ext):.0f} tok/s",
                f"{_tok_s(count * n, plain):.0f} tok/s",
                plain / ext,
                "info",
            ),
            Row(
                f"cost growth, {count}x{n} tokens: worker peak RSS, extraction vs without",
                f"{rss['extract']:.0f} MiB",
                f"{rss['plain']:.0f} MiB",
                rss["extract"] / rss["plain"],
                "info",
            ),
        ]
    return rows


def _load_rows(load: OtherLoad) -> list[Row]:
    cpus = os.cpu_count() or 1
    return [
        Row(
            f"other processes' CPU during {phase} (not this bench) vs cores",
            f"{cores:.2f} cores",
            f"{cpus} cores",
            cores / cpus,
            "0 (a quiet machine)",
        )
        for phase, cores in load.cores.items()
    ]


def main() -> None:
    """``python -m experiments.machine_limits.limits_bench [--quick]``: print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, two lengths")
    quick = parser.parse_args().quick
    print_rows(run, quick, "hsx-limits-bench-")


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
