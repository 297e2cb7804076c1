"""Where extraction's time goes: an A/B harness with an optional py-spy profile.

``python -m experiments.worker_profile.profile_worker [--profile]`` starts one
``Extractor`` on a 100M-parameter random Llama (hidden 1024, 8 layers, float32, layer
ids [2, 4, 5, 8], prefix caching off, ``max_num_batched_tokens`` 2048) and runs
interleaved rounds of

(a) the same engine without extraction: ``extractor.engine.generate`` with
    ``max_tokens=1`` and no hsx ``extra_args``, so nothing is copied out or stored;
(b) ``Extractor.extract`` of the same prompts to local disk (fsync'd).

Each round runs all prompts at once. It prints each round's tokens per second, the CPU
seconds the engine process spent (all its threads, from ``/proc``), the medians and
the ratio b / a (the issue's target: at least 0.95). The order alternates from round to
round so drift hits both sides alike. With ``--profile``, py-spy samples the engine
process during every (b) round and the top functions by own and by cumulative samples,
and the samples per thread, are printed (py-spy's ``raw`` format: collapsed stacks).
This is the profiling tool; ``benchmarks/engine_bench.py`` writes the official rows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import Settings
from service.engine.introspect import HsxWorkerExtension

LAYER_IDS = [2, 4, 5, 8]
EXTENSION = "experiments.worker_profile.profile_worker.ProfileWorkerExtension"


class ProfileWorkerExtension(HsxWorkerExtension):
    """hsx's worker extension plus a switch for where the writer threads run, so one
    engine compares placements round by round under the same load."""

    def hsx_profile_cache(self) -> dict[str, Any]:
        """The hidden-state cache's shape and whether the fast row gather applies."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        cache = get_kv_transfer_group()._worker._cache
        return {"shape": list(cache.shape), "contiguous": cache.is_contiguous()}

    def hsx_profile_place_writers(self, cpus: str, nice: int) -> list[int]:
        """``place_writers`` in the worker (collective_rpc runs on its forward thread)."""
        return place_writers(cpus, nice)


def place_writers(cpus: str, nice: int) -> list[int]:
    """Move every ``hsx-*`` thread: ``cpus`` is ``fwd`` (the calling, forward pass's
    thread's CPUs, where vLLM's binding leaves threads started from it), ``others`` (the
    rest) or ``all``; ``nice`` is their nice value. Returns the CPUs chosen."""
    forward = os.sched_getaffinity(0)
    every = set(range(os.cpu_count() or 1))
    chosen = {"fwd": forward, "others": (every - forward) or every, "all": every}[cpus]
    for thread in threading.enumerate():
        if thread.name.startswith("hsx-") and thread.native_id is not None:
            os.sched_setaffinity(thread.native_id, chosen)
            os.setpriority(os.PRIO_PROCESS, thread.native_id, nice)
    return sorted(chosen)


@dataclass
class Round:
    side: str
    seconds: float
    tokens: int
    cpu: dict[str, float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def settings_for(model: Path, objects: Path, tokens: int, fsync: bool = True) -> Settings:
    """The issue's engine: float32, 2048-token steps, no prefix caching, eager."""
    return Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "layer_ids": LAYER_IDS,
            "max_model_len": tokens + 16,
            "max_num_batched_tokens": 2048,
            "enable_prefix_caching": False,
            "cpu_kvcache_space_gib": 2,
            "extra_args": {"enforce_eager": True, "worker_extension_cls": EXTENSION},
        },
        storage={"url": str(objects), "local": {"fsync": fsync}},
    )


def model_at(path: Path) -> Path:
    """The 100M random Llama at ``path``, made there once."""
    from service.engine.tiny_models import make_model

    if (path / "model.safetensors").exists():
        return path
    return make_model(path, "llama", hidden_size=1024, num_layers=8, max_len=4096)


def prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(tokens)] for _ in range(count)]


async def plain(extractor: Any, batch: list[list[int]]) -> None:
    """(a) The same engine, requests without extraction."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    async def one(prompt: list[int]) -> None:
        stream = extractor.engine.generate(
            TokensPrompt(prompt_token_ids=prompt), sampling, f"plain-{uuid.uuid4().hex}"
        )
        async for _ in stream:
            pass

    await asyncio.gather(*(one(p) for p in batch))


async def extract(extractor: Any, batch: list[list[int]]) -> list[str]:
    """(b) ``Extractor.extract`` to local disk; the keys written."""
    done = await asyncio.gather(
        *(extractor.extract(p, extractor.request_params("profile")) for p in batch)
    )
    return [d.key for d in done]


def worker_pid() -> int:
    """vLLM's worker process (model, forward pass, our connector's worker half)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        if "Worker" in child.name():
            return int(child.pid)
    raise RuntimeError(f"no vLLM worker among {[c.name() for c in children]}")


def py_spy() -> str:
    return str(Path(sys.executable).with_name("py-spy"))


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name (``py-spy dump``), numbers stripped."""
    try:
        out = subprocess.run(  # noqa: S603 - our own venv's py-spy
            [py_spy(), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for match in re.finditer(r'^Thread (\d+) \([^)]*\): "(.*)"$', out, re.MULTILINE):
        names[int(match[1])] = re.sub(r"[_-]\d+$", "", match[2])
    return names


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def cpu_by_group(
    before: dict[int, float], after: dict[int, float], names: dict[int, str], pid: int
) -> dict[str, float]:
    """CPU seconds spent between two readings, by thread name; threads Python does not
    know (torch's OpenMP team, ZeroMQ's) are ``native``."""
    groups: dict[str, float] = {}
    for tid, total in after.items():
        name = "MainThread (forward pass)" if tid == pid else names.get(tid, "native threads")
        groups[name] = groups.get(name, 0.0) + total - before.get(tid, 0.0)
    return groups


class Sampler:
    """py-spy recording the engine process while a block runs; samples accumulate."""

    def __init__(self, pid: int, out: Path, rate: int) -> None:
        self.pid, self.out, self.rate = pid, out, rate
        self.stacks: Counter[str] = Counter()
        self._proc: subprocess.Popen[bytes] | None = None
        self._runs = 0

    def start(self) -> None:
        self._runs += 1
        path = self.out / f"profile-{self._runs}.txt"
        self._proc = subprocess.Popen(  # noqa: S603 - our own venv's py-spy
            [
                py_spy(), "record", "--pid", str(self.pid), "--rate", str(self.rate),
                "--format", "raw", "--threads", "--nonblocking", "--output", str(path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._path = path
        time.sleep(0.5)  # let it attach before the round starts

    def stop(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        self._proc.wait(timeout=60)
        for line in self._path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack:
                self.stacks[stack] += int(count)

    def report(self, top: int, names: dict[int, str]) -> str:
        own: Counter[str] = Counter()
        cumulative: Counter[str] = Counter()
        threads: Counter[str] = Counter()
        total = sum(self.stacks.values()) or 1
        for stack, count in self.stacks.items():
            frames = [_frame(f) for f in stack.split(";")]
            tid = re.search(r"\d+", frames[0])
            thread = (
                names.get(int(tid[0]), frames[0])
                if tid and tid[0] != str(self.pid)
                else "MainThread"
            )
            threads[thread] += count
            calls = frames[1:] or frames
            own[calls[-1]] += count
            for frame in set(calls):
                cumulative[frame] += count
        lines = [f"\npy-spy: {total} samples of the worker process (on-CPU, Python threads)"]
        for title, counter in (
            ("samples per thread", threads),
            ("top by own samples", own),
            ("top by cumulative samples", cumulative),
        ):
            lines.append(f"\n{title}:")
            for name, count in counter.most_common(top):
                lines.append(f"  {100 * count / total:5.1f}%  {name}")
        return "\n".join(lines)


def _frame(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (file.py)``: lines of one function merged."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(Path(file).parts[-2:])})"


async def timed_round(
    side: str, fn: Callable[[], Awaitable[object]], pid: int, tokens: int, names: dict[int, str]
) -> Round:
    before = thread_cpu(pid)
    start = time.perf_counter()
    await fn()
    seconds = time.perf_counter() - start
    return Round(side, seconds, tokens, cpu_by_group(before, thread_cpu(pid), names, pid))


async def run(args: argparse.Namespace, scratch: Path) -> None:
    from service.engine.extractor import Extractor

    model = model_at(args.model or scratch / "model-100m")
    settings = settings_for(model, scratch / "objects", args.tokens, not args.no_fsync)
    extractor = await Extractor.start(settings)
    try:
        pid = worker_pid()
        sampler = Sampler(pid, scratch, args.rate) if args.profile else None
        batch = prompts(args.prompts, args.tokens, seed=0)
        await plain(extractor, batch)  # warm-up, not counted
        await _remove(extractor, await extract(extractor, batch))
        names = thread_names(pid)  # every writer thread exists by now
        print(f"hidden-state cache: {(await extractor.on_workers('hsx_profile_cache'))[0]}")
        sides = ["plain", *(f"extract:{v}" for v in args.variants or [""])]
        rounds: list[Round] = []
        for n in range(args.rounds):
            batch = prompts(args.prompts, args.tokens, seed=n + 1)
            for side in sides[n % len(sides) :] + sides[: n % len(sides)]:
                r = await one_round(extractor, side, batch, pid, names, sampler)
                rounds.append(r)
                print(
                    f"round {n + 1} {side:16s} {r.tok_s:7.0f} tok/s  {r.seconds:6.2f} s  "
                    f"worker CPU {sum(r.cpu.values()):6.2f} s",
                    flush=True,
                )
        print(summary(rounds, len(sides)))
        if sampler is not None:
            print(sampler.report(args.top, names))
    finally:
        await extractor.close()


async def one_round(
    extractor: Any,
    side: str,
    batch: list[list[int]],
    pid: int,
    names: dict[int, str],
    sampler: Sampler | None,
) -> Round:
    """One timed batch of ``side``; its objects are removed afterwards, untimed.

    ``extract:CPUS[:NICE]`` first moves the writer threads (``ProfileWorkerExtension``);
    plain ``extract:`` leaves them where hsx puts them.
    """
    keys: list[str] = []
    _, _, variant = side.partition(":")
    if variant:
        cpus, _, nice = variant.partition(":")
        await extractor.engine.collective_rpc(
            "hsx_profile_place_writers", args=(cpus, int(nice or 0))
        )

    async def go() -> None:
        if side == "plain":
            await plain(extractor, batch)
        else:
            keys.extend(await extract(extractor, batch))

    profiled = sampler if side != "plain" else None
    if profiled is not None:
        profiled.start()
    r = await timed_round(side, go, pid, sum(map(len, batch)), names)
    if profiled is not None:
        profiled.stop()
    await _remove(extractor, keys)
    return r


async def _remove(extractor: Any, keys: list[str]) -> None:
    await asyncio.gather(*(extractor.storage.delete(k) for k in keys))


def summary(rounds: list[Round], per_round: int) -> str:
    """Medians per side with their spread; each extraction side's ratio to plain, as a
    ratio of medians and as the median of each round's own ratio; CPU by thread."""
    sides: dict[str, list[Round]] = {}
    for r in rounds:
        sides.setdefault(r.side, []).append(r)
    plain_speed = statistics.median(r.tok_s for r in sides["plain"])
    lines = []
    for side, rs in sides.items():
        speeds = [r.tok_s for r in rs]
        line = (
            f"{side:16s} median {statistics.median(speeds):7.0f} tok/s "
            f"(min {min(speeds):.0f}, max {max(speeds):.0f}, n={len(rs)})"
        )
        if side != "plain":
            paired = [
                r.tok_s / p.tok_s
                for i in range(0, len(rounds), per_round)
                for r in rounds[i : i + per_round]
                for p in rounds[i : i + per_round]
                if r.side == side and p.side == "plain"
            ]
            line += (
                f"; ratio to plain {statistics.median(speeds) / plain_speed:.3f}, "
                f"per round {statistics.median(paired):.3f} "
                f"(min {min(paired):.3f}, max {max(paired):.3f})"
            )
        lines.append(line)
    groups = sorted(
        {g for r in rounds for g in r.cpu}, key=lambda g: -sum(r.cpu.get(g, 0) for r in rounds)
    )
    lines.append("\nworker CPU seconds per round (median), by thread:")
    lines.append(f"  {'thread':28s} " + " ".join(f"{side[-14:]:>14s}" for side in sides))
    for group in [*groups, "total"]:
        cells = []
        for rs in sides.values():
            values = [
                sum(r.cpu.values()) if group == "total" else r.cpu.get(group, 0.0) for r in rs
            ]
            cells.append(f"{statistics.median(values):14.2f}")
        lines.append(f"  {group[:28]:28s} " + " ".join(cells))
    return "\n".join(lines)


async def writer_only(args: argparse.Namespace, scratch: Path) -> None:
    """The writer's per-object work alone, in this process: CPU milliseconds per object
    for each way of serialising, interleaved batch by batch through one real
    ``LocalStorage`` (fsync'd unless ``--no-fsync``).

    ``bytes``: validate, ``objects.serialize`` to one bytes object, ``put`` it (the
    writer before this profile); ``parts``: validate, ``serialize_parts`` (header plus
    the tensor's own memory), ``put`` the pieces (the writer now). Each batch is
    ``--prompts`` objects of ``--tokens`` tokens (4 layers, hidden 1024, float32), 8 at
    a time, like the writer pool's 8 threads. CPU time counts every thread of this
    process, so it is steadier than wall time on a shared machine.
    """
    import torch

    from service.config import StorageSettings
    from service.engine.objects import object_metadata, serialize_parts
    from service.engine.validation import check_states
    from service.storage import open_storage
    from service.storage.keys import new_object_key

    storage = open_storage(
        StorageSettings(url=str(scratch / "objects"), local={"fsync": not args.no_fsync})
    )
    states = [torch.randn(args.tokens, len(LAYER_IDS), 1024) for _ in range(8)]
    metadata = object_metadata("m", LAYER_IDS, "float32")
    limit = asyncio.Semaphore(8)

    def encode(way: str, state: Any) -> Any:
        check_states(state)
        if way == "bytes":
            return b"".join(serialize_parts("raw", state, torch.arange(args.tokens), metadata))
        return serialize_parts("raw", state, torch.arange(args.tokens), metadata)

    async def one(way: str, state: Any) -> str:
        async with limit:
            data = await asyncio.to_thread(encode, way, state)
            return (await storage.put(new_object_key("hsx", "w"), data)).key

    cpu: dict[str, list[float]] = {"bytes": [], "parts": []}
    try:
        for n in range(args.rounds):
            for way in ("bytes", "parts") if n % 2 == 0 else ("parts", "bytes"):
                start = time.process_time()
                keys = await asyncio.gather(*(one(way, states[i % 8]) for i in range(args.prompts)))
                cpu[way].append(1000 * (time.process_time() - start) / args.prompts)
                await asyncio.gather(*(storage.delete(k) for k in keys))
            print(f"batch {n + 1}: " + ", ".join(f"{w} {v[-1]:.2f}" for w, v in cpu.items()))
        for way, values in cpu.items():
            print(
                f"{way:6s} median {statistics.median(values):.2f} ms CPU per object "
                f"(min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"
            )
    finally:
        await storage.close()


def interference(args: argparse.Namespace, scratch: Path) -> None:
    """How much the writer slows a forward pass, by where its threads run.

    A stand-in for vLLM's CPU worker without an engine: this thread runs float32 GEMMs
    (2048x1024 by 1024x3072, 32 per "step", about a step of the 100M model) on a
    two-thread OpenMP team bound to CPUs 0 and 1 as vLLM binds it, and starts the
    writer pool, as the connector does. Each window is two steps with 8 objects of the
    A/B's size submitted at the start of each (``none``: no objects), timed until the
    last object is durable; placements rotate window by window. Pure GEMMs leave the
    writers no idle moments to use, unlike the engine's steps: a worst case.
    """
    import torch
    import zmq

    from service.config import StorageSettings
    from service.engine.completion import CompletionSender, new_secret
    from service.engine.jobs import CopyOut, PendingSave, WriteJob
    from service.engine.objects import object_metadata
    from service.engine.writer import WriterPool
    from service.storage.keys import new_object_key

    a, b = torch.randn(2048, 1024), torch.randn(1024, 3072)
    out = torch.mm(a, b)  # the OpenMP team starts, bound by OMP_PLACES
    print(f"forward thread bound to CPUs {sorted(os.sched_getaffinity(0))}")
    address = f"ipc://{scratch / 'interference.sock'}"
    pull: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    pool = WriterPool(
        StorageSettings(url=str(scratch / "objects")),
        CompletionSender(address, new_secret()),  # the PULL end here only drains
        max_bytes_in_flight=2**40,
        max_concurrent_writes=8,
    )
    states = [torch.randn(args.tokens, len(LAYER_IDS), 1024) for _ in range(8)]
    metadata = object_metadata("m", LAYER_IDS, "float32")
    variants = ["none", *(args.variants or ["fwd", "others"])]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for n in range(args.rounds):
            for variant in variants[n % len(variants) :] + variants[: n % len(variants)]:
                if variant != "none":
                    cpus, _, nice = variant.partition(":")
                    place_writers(cpus, int(nice or 0))
                start, written = time.perf_counter(), 0
                for _ in range(2):
                    if variant != "none":
                        for state in states:
                            key = new_object_key("hsx", "i")
                            ids = tuple(range(args.tokens))
                            save = PendingSave("i", key, ids, (), metadata, tuple(LAYER_IDS))
                            job = WriteJob(
                                save, CopyOut({"hidden_states": state}), state.numel() * 4
                            )
                            assert pool.budget.reserve(job.nbytes)
                            pool.submit(job)
                            written += 1
                    for _ in range(32):
                        torch.mm(a, b, out=out)
                for _ in range(written):
                    pull.recv()
                rates[variant].append(64 / (time.perf_counter() - start))
            print(f"window set {n + 1}: " + ", ".join(f"{v} {r[-1]:.2f}" for v, r in rates.items()))
        base = statistics.median(rates["none"])
        for variant, r in rates.items():
            print(
                f"{variant:12s} median {statistics.median(r):6.2f} GEMM/s "
                f"(min {min(r):.2f}, max {max(r):.2f}); vs none {statistics.median(r) / base:.3f}"
            )
    finally:
        pool.close()
        pull.close()
        for path in (scratch / "objects").rglob("*.safetensors"):
            path.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.worker_profile.profile_worker")
    parser.add_argument("--profile", action="store_true", help="py-spy the engine during (b)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each side")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25, help="functions listed per table")
    parser.add_argument("--model", type=Path, help="where the model is kept (made once)")
    parser.add_argument("--writer", action="store_true", help="the writer pool alone, no engine")
    parser.add_argument(
        "--interference",
        action="store_true",
        help="GEMMs bound like vLLM's CPU worker while the writer writes, by placement",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        help="writer placements, each its own extraction side: CPUS[:NICE], CPUS one of "
        "fwd (the forward pass's CPUs), others, all; e.g. fwd others others:10",
    )
    parser.add_argument(
        "--no-fsync", action="store_true", help="experiment only: objects are not made durable"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="hsx-profile-") as scratch:
        if args.interference:
            # vLLM's CPU worker binding on a 2-CPU machine: one OpenMP thread per CPU,
            # set before torch starts its team.
            os.environ.update(OMP_NUM_THREADS="2", OMP_PLACES="{0},{1}", OMP_PROC_BIND="close")
            interference(args, Path(scratch))
            return
        asyncio.run((writer_only if args.writer else run)(args, Path(scratch)))


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
