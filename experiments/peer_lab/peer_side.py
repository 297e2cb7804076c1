"""One side of the peer bench, in a process of its own: one engine, one round.

``python -m experiments.peer_lab.peer_side --side SIDE --model DIR --layers 2,4,5,8
--sets 256x64@8,... --seed N --work DIR --out FILE`` starts one engine, warms it up,
runs each prompt set once with its number of prompts in flight, shuts the engine down
and writes ``{"seconds": {set: wall seconds}, ...}`` to ``FILE``. ``peer_bench``
starts one such process per side per round, so only one engine is alive at a time and
no engine inherits state (threads, allocator, binding) from another.

Sides: ``hsx`` (``Extractor.extract``: durable objects), ``hsx-plain`` (the same engine,
plain requests), ``peer`` (a stock ``AsyncLLM`` with ``extract_hidden_states`` and
vLLM's ``ExampleHiddenStatesConnector``, ``experiments.peer_lab.peer_connector``; a request is
done when its file's lock is released) and ``stock`` (a stock ``AsyncLLM``, no
speculative method, no connector, plain requests). Two more isolate one difference
each between hsx's engine and a stock one: ``stock-spec`` (a stock engine with the
``extract_hidden_states`` method but no connector) and ``stock-sync`` (a stock engine
with vLLM's async scheduling off, as vLLM turns it off for that method). hsx's malloc
setting needs no side of its own: the bench gives it to every side's processes
(``peer_bench.side_environment``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import fork_engine_server, timed
from benchmarks.engine_sides import WARM_PROMPTS, Prompts, Side, extraction_side, plain_side
from service.config import Settings
from service.engine.vllm_patches.openmp import parse_cpus

SIDES = ("hsx", "hsx-plain", "peer", "stock", "stock-spec", "stock-sync")
#: The largest chunk of prompt tokens one engine step takes, on every side.
MAX_BATCHED_TOKENS = 2048
#: Prompt token ids are drawn from [3, VOCAB): the random model's vocabulary, and
#: ordinary ids of the demo model's.
VOCAB = 512


@dataclass(frozen=True)
class PromptSet:
    """``count`` prompts of ``length`` tokens, ``in_flight`` of them submitted at a time."""

    length: int
    count: int
    in_flight: int

    @property
    def name(self) -> str:
        """``LENGTHxCOUNT@IN_FLIGHT``, the key of its time in the result."""
        return f"{self.length}x{self.count}@{self.in_flight}"

    @classmethod
    def parse(cls, text: str) -> PromptSet:
        """The inverse of :attr:`name`."""
        shape, in_flight = text.split("@")
        length, count = shape.split("x")
        return cls(int(length), int(count), int(in_flight))


def prompts_for(prompt_set: PromptSet, seed: int) -> Prompts:
    """Fresh random prompts for one set of one round: the same on every side (the
    seed names the round), never seen before by the engine (prefix caching is off on
    every side anyway)."""
    rng = random.Random(f"{seed}-{prompt_set.name}")
    return [
        [rng.randrange(3, VOCAB) for _ in range(prompt_set.length)] for _ in range(prompt_set.count)
    ]


async def in_flight(side: Side, prompts: Prompts, limit: int) -> None:
    """Every prompt through ``side``, at most ``limit`` at a time."""
    gate = asyncio.Semaphore(limit)

    async def one(prompt: list[int]) -> None:
        async with gate:
            await side.run([prompt])

    await asyncio.gather(*(one(p) for p in prompts))


def hsx_settings(args: argparse.Namespace) -> Settings:
    """The engine settings every side starts from (peer and stock drop hsx's parts)."""
    return Settings(
        engine={
            "model": str(args.model),
            "dtype": "float32",
            "layer_ids": args.layers,
            "max_model_len": args.max_len,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "cpu_kvcache_space_gib": args.kv_gib,
            "enable_prefix_caching": False,
            "extra_args": {"enforce_eager": True},
        },
        storage={"url": str(args.work / "hsx-objects")},
        limits={"max_queued_prompts": 4096},
    )


def vllm_args(settings: Settings, connector_dir: Path | None, side: str = "stock") -> Any:
    """hsx's own engine arguments with hsx's connector and worker extension taken out;
    with ``connector_dir`` the speculative method stays and vLLM's connector writes
    there, without it the speculative method goes too (the stock engine), except on
    ``stock-spec`` (the speculative method, no connector); ``stock-sync`` is the stock
    engine with async scheduling off."""
    from vllm.config import KVTransferConfig

    from service.engine.builder import engine_args, read_model_info

    info = read_model_info(str(settings.engine.model))
    layers = list(settings.engine.layer_ids or [])
    args = engine_args(settings, info, layers, "ipc://unused")
    if side == "stock-spec":
        return dataclasses.replace(args, kv_transfer_config=None, worker_extension_cls="")
    if connector_dir is None:
        stock = dataclasses.replace(
            args, speculative_config=None, kv_transfer_config=None, worker_extension_cls=""
        )
        # None: vLLM's choice (on for a stock engine); vLLM forces it off for the method.
        return dataclasses.replace(stock, async_scheduling=False) if side == "stock-sync" else stock
    connector = KVTransferConfig(
        kv_connector="CpuHiddenStatesConnector",
        kv_connector_module_path="experiments.peer_lab.peer_connector",
        kv_role="kv_producer",
        kv_connector_extra_config={"shared_storage_path": str(connector_dir)},
    )
    return dataclasses.replace(args, kv_transfer_config=connector, worker_extension_cls="")


def peer_side(engine: Any, directory: Path) -> Side:
    """Plain requests on the peer engine, each done when the connector's file is."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from experiments.peer_lab.peer_connector import wait_for_file

    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    async def one(prompt: list[int]) -> None:
        final = None
        request = TokensPrompt(prompt_token_ids=prompt)
        async for output in engine.generate(request, sampling, f"peer-{uuid.uuid4().hex}"):
            final = output
        if final is None or not final.kv_transfer_params:
            raise RuntimeError("the peer's connector named no file")
        await asyncio.to_thread(wait_for_file, final.kv_transfer_params["hidden_states_path"])

    async def run(prompts: Prompts) -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    async def clear() -> None:
        await asyncio.to_thread(shutil.rmtree, directory, True)

    return Side(run, clear)


@contextlib.asynccontextmanager
async def open_side(args: argparse.Namespace) -> AsyncIterator[Side]:
    """The engine of ``args.side``, started, as a :class:`Side`; shut down on exit."""
    settings = hsx_settings(args)
    if args.side in ("hsx", "hsx-plain"):
        from service.engine.extractor import Extractor

        extractor = await Extractor.start(settings)
        try:
            yield extraction_side(extractor) if args.side == "hsx" else plain_side(extractor.engine)
        finally:
            await extractor.close()
        return
    from vllm.v1.engine.async_llm import AsyncLLM

    from service.engine.extractor import _release_vllm_resources
    from service.engine.prestart import use_preloaded_processes

    # Its processes start as hsx's do (Extractor.start), but keep vLLM's spinning
    # queue polls (the default polling): the stock and peer sides are vLLM as shipped.
    use_preloaded_processes()
    directory = args.work / "peer-files" if args.side == "peer" else None
    engine = AsyncLLM.from_engine_args(vllm_args(settings, directory, args.side))
    try:
        yield plain_side(engine) if directory is None else peer_side(engine, directory)
    finally:
        engine.shutdown()
        _release_vllm_resources(engine)


def worker_cpus() -> list[str]:
    """The CPUs each of this side's vLLM workers (``VLLM::Worker`` processes) is bound
    to, e.g. ``["1"]``: the binding the forward pass got (its writer threads, on an hsx
    side, run elsewhere on purpose)."""
    import psutil

    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError, IndexError):
            if process.cmdline()[0].startswith("VLLM::Worker"):
                found.append(",".join(str(c) for c in sorted(os.sched_getaffinity(process.pid))))
    return sorted(found)


def thread_cpus() -> dict[str, int]:
    """How many threads of this process's descendants (the engine's processes) may run
    on which CPUs, e.g. ``{"0": 1, "1": 1, "0,1": 40}``: the binding each side got."""
    import psutil

    counts: dict[str, int] = {}
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):
            for thread in process.threads():
                cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(thread.id)))
                counts[cpus] = counts.get(cpus, 0) + 1
    return counts


def _busy_seconds() -> float:
    """CPU seconds every process of the machine has used so far (all CPUs)."""
    import psutil

    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def _own_processes() -> list[Any]:
    """This process and its descendants (the engine's), as ``psutil.Process`` objects."""
    import psutil

    return [psutil.Process(), *psutil.Process().children(recursive=True)]


def _own_seconds() -> float:
    """CPU seconds this process and its descendants (the engine) have used so far."""
    import psutil

    total = 0.0
    for process in _own_processes():
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _own_faults() -> int:
    """Minor page faults this process and its descendants (the engine) have taken so far:
    with 4 KiB pages a forward pass's fresh memory costs one each, with huge pages one
    per 2 MiB, so a side whose set times spread can be checked against them."""
    import psutil

    total = 0
    for process in _own_processes():
        with contextlib.suppress(psutil.Error, OSError, IndexError, ValueError):
            stat = Path(f"/proc/{process.pid}/stat").read_text()
            total += int(stat.rsplit(")", 1)[1].split()[7])  # minflt, field 10
    return total


def thread_seconds() -> dict[str, float]:
    """CPU seconds so far of every thread of this process and its descendants, summed by
    ``process name/thread name`` as the kernel has them (``VLLM::Worker/gloo_tcp_loop``;
    threads Python started keep their process's name, unless they name themselves, as
    hsx's pool threads do, ``service/threads.py``; a thread a named thread starts, a
    library's own, inherits that name): where a side's CPU goes, for
    ``diary.md``."""
    import psutil

    found: dict[str, float] = {}
    for process in _own_processes():
        with contextlib.suppress(psutil.Error, OSError):
            prefix = process.name()
            for thread in process.threads():
                with contextlib.suppress(OSError):  # a thread gone since the listing
                    name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text()
                    key = f"{prefix}/{name.strip()}"
                    found[key] = found.get(key, 0.0) + thread.user_time + thread.system_time
    return found


@dataclass
class SetResult:
    """What one timed set gave (``timed_set``)."""

    seconds: float
    cpu: float  # this process and its engine
    foreign: float  # share of the machine's CPU other processes used meanwhile
    threads: dict[str, float]  # CPU seconds by process/thread name (``thread_seconds``)
    faults: int = 0  # minor page faults of this process and its engine (``_own_faults``)


async def timed_set(side: Side, prompt_set: PromptSet, seed: int) -> SetResult:
    """Wall seconds of one set, the CPU seconds this process and its engine spent on it
    (also by thread), and the share of the machine's CPU time that other processes used
    meanwhile (the bench's measurements need it near 0)."""
    prompts = prompts_for(prompt_set, seed)
    run = functools.partial(in_flight, side, prompts, prompt_set.in_flight)
    busy, own, threads = _busy_seconds(), _own_seconds(), thread_seconds()
    faults = _own_faults()
    seconds = (await timed(run, 1))[0]
    faults = _own_faults() - faults
    own = _own_seconds() - own
    after = thread_seconds()
    by_thread = {k: round(v - threads.get(k, 0.0), 3) for k, v in after.items()}
    foreign = (_busy_seconds() - busy) - own
    share = max(foreign, 0.0) / (seconds * (os.cpu_count() or 1))
    threads_used = {k: v for k, v in by_thread.items() if v > 0}
    return SetResult(seconds, own, share, threads_used, faults)


async def one_round(args: argparse.Namespace) -> dict[str, Any]:
    """Start the side's engine, warm it up, time every set once, shut it down."""
    sets = [PromptSet.parse(s) for s in args.sets]
    started = time.perf_counter()
    async with open_side(args) as side:
        start_s = time.perf_counter() - started
        for length in sorted({s.length for s in sets}):  # every shape once, untimed
            await side.run(prompts_for(PromptSet(length, WARM_PROMPTS, 1), -1))
            await side.clear()
        bound, workers = thread_cpus(), worker_cpus()
        results = {}
        for prompt_set in sets:
            results[prompt_set.name] = await timed_set(side, prompt_set, args.seed)
            await side.clear()
    return {
        "side": args.side,
        "seconds": {name: r.seconds for name, r in results.items()},
        "cpu_seconds": {name: r.cpu for name, r in results.items()},
        "foreign_cpu": {name: r.foreign for name, r in results.items()},
        "thread_seconds": {name: r.threads for name, r in results.items()},
        "minor_faults": {name: r.faults for name, r in results.items()},
        "start_s": start_s,
        "thread_cpus": bound,
        "worker_cpus": workers,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of one side's process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layers", type=lambda s: [int(i) for i in s.split(",")], required=True)
    parser.add_argument("--sets", type=lambda s: s.split(","), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-len", type=int, default=2064)
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--bind", help="VLLM_CPU_OMP_THREADS_BIND for this side's engine")
    parser.add_argument(
        "--others", help="CPUs for this process and the engine's processes but its workers"
    )
    return parser.parse_args(argv)


def main() -> None:
    """Run one side for one round; the result goes to ``--out`` as JSON."""
    args = parse_args()
    if args.bind:  # read by vLLM's executor when it starts the worker
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind
    if args.others:  # inherited by the engine core; the workers bind themselves
        os.sched_setaffinity(0, parse_cpus(args.others) or os.sched_getaffinity(0))
    fork_engine_server()  # each side alike: start-up only, not the timed sets
    result = asyncio.run(one_round(args))
    result["bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # vLLM starts its engine processes from this one: guard it
    main()
