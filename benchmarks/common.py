"""What every bench shares: the row type, timing, CPU accounting and a served engine.

A leaf of ``benchmarks/``: it imports no bench, so ``run.py`` imports the benches and
each bench imports this, never ``run.py`` or another bench's helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import resource
import signal
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import Settings

#: ``timer(fn, repeats)``: wall times of ``repeats`` calls of ``fn`` (see :func:`timed`).
Timer = Callable[[Callable[[], Awaitable[object]], int], Awaitable[list[float]]]


@dataclass
class Row:
    """One line of the table in docs/benchmarks.md."""

    name: str
    ours: str
    baseline: str
    ratio: float
    target: str


def ms(seconds: float, digits: int = 1) -> str:
    """``seconds`` as milliseconds with ``digits`` decimals."""
    return f"{seconds * 1000:.{digits}f} ms"


def table_line(row: Row) -> str:
    """``row`` as a Markdown table line."""
    return f"| {row.name} | {row.ours} | {row.baseline} | {row.ratio:.2f} | {row.target} |"


async def timed(fn: Callable[[], Awaitable[object]], repeats: int) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn``: the :data:`Timer` every bench gets."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return times


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``hsx serve`` gets from uvicorn (uvloop when installed), so both
    sides of an HTTP comparison run on it; None for asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# --- CPU seconds per process -------------------------------------------------------


@dataclasses.dataclass
class CpuSeconds:
    """CPU seconds one round cost each process: the runner (a child that has exited),
    this process (the API server, or the in-process caller) and the engine's."""

    runner: float = 0.0
    server: float = 0.0
    engine: float = 0.0


@contextlib.contextmanager
def cpu_seconds(out: list[CpuSeconds]) -> Iterator[None]:
    """Append the CPU seconds spent inside the block to ``out`` (warm-up rounds too)."""
    import psutil

    def engine() -> float:
        total = 0.0
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                times = child.cpu_times()
                total += times.user + times.system
        return total

    def children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    before = (children(), time.process_time(), engine())
    try:
        yield
    finally:
        out.append(
            CpuSeconds(
                children() - before[0], time.process_time() - before[1], engine() - before[2]
            )
        )


def cpu_text(cpu: dict[str, list[CpuSeconds]], child: str = "runner") -> str:
    """Each side's median CPU seconds per round, per process; ``child`` names the
    child process the bench ran (the runner, or the API bench's client)."""
    parts = []
    for side, rounds in cpu.items():
        timed = rounds[1:]  # the first is the warm-up
        median = {
            name: statistics.median(getattr(c, name) for c in timed)
            for name in ("runner", "server", "engine")
        }
        text = ", ".join(
            f"{child if name == 'runner' else name} {value:.2f}"
            for name, value in median.items()
            if value >= 0.005
        )
        parts.append(f"{side}: {text}")
    return "; ".join(parts)


def fork_engine_server() -> bool:
    """Fork this process's engine fork server from it, as ``hsx serve`` does
    (``service.engine.prestart.fork_server_here``), so the server does not import vLLM
    a second time (about 7 CPU-seconds). Only first thing in a bench's own process,
    before any forward pass ran in it (OpenMP's pool would not survive the fork); what
    is measured does not change: the engine processes are forked either way, and each
    engine sets its own pause between queue polls when it starts."""
    import vllm.v1.engine.async_llm  # noqa: F401 - the server should hold it already

    from service.engine.prestart import fork_server_here

    return fork_server_here()


#: The repository root: every bench child runs from it.
REPO = Path(__file__).resolve().parent.parent


class Preforked:
    """A process that imported ``preload`` once (``benchmarks.preforked``); each
    :meth:`run` is a child forked from it that runs ``python -m module args`` as a fresh
    interpreter would, without importing those libraries again (vLLM, or torch with
    speculators: about 8 CPU-seconds each on this machine). One job at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self._proc = proc
        self._log = log
        self._ready = False
        self._one = asyncio.Lock()

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls, preload: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> AsyncIterator[Preforked]:
        """Start the process (it imports meanwhile; its own output goes to ``log``),
        with ``env`` (default: this process's); stop it on the way out."""
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.preforked", *preload,
                cwd=REPO, env=dict(os.environ if env is None else env),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=sink,
            )  # fmt: skip
        try:
            yield cls(proc, log)
        finally:
            if proc.returncode is None:
                assert proc.stdin is not None
                proc.stdin.close()  # the end of the job list: it exits
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

    async def _answer(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            if line.startswith(b"{"):  # a library may print while it imports
                answer: dict[str, Any] = json.loads(line)
                return answer
        await self._proc.wait()
        tail = (await asyncio.to_thread(self._log.read_text, errors="replace"))[-4000:]
        raise RuntimeError(f"the preforked process exited:\n{tail}")

    async def ready(self) -> None:
        """Wait until the process has imported ``preload`` (its CPU work is done)."""
        async with self._one:
            if not self._ready:
                await self._answer()  # {"ready": true}: the imports are done
                self._ready = True

    async def run(self, module: str, *args: str, log: Path, timeout_s: float | None = None) -> str:
        """``python -m module args`` in a forked child, its output going to ``log``;
        the output. A failure raises with the output's tail; past ``timeout_s`` the
        child is killed and ``TimeoutError`` raised."""
        await self.ready()
        async with self._one:
            assert self._proc.stdin is not None
            job = {"module": module, "args": list(args), "log": str(log)}
            self._proc.stdin.write((json.dumps(job) + "\n").encode())
            await self._proc.stdin.drain()
            pid = (await self._answer())["pid"]
            try:
                status = (await asyncio.wait_for(self._answer(), timeout_s))["exit"]
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                await self._answer()  # its exit: the next job may start
                raise
        return await child_output(module, status, log)

    @property
    def pid(self) -> int:
        """The preloaded process's pid (every job's parent)."""
        return self._proc.pid


async def child_output(module: str, status: int, log: Path) -> str:
    """What ``python -m module`` wrote to ``log``; raises with its tail when ``status``
    (its exit status) is not 0."""
    text = await asyncio.to_thread(log.read_text, errors="replace")
    if status != 0:
        raise RuntimeError(f"python -m {module} failed ({status}):\n{text[-4000:]}")
    return text


def last_json(output: str) -> dict[str, Any]:
    """The last line of a child's output that is a JSON object (libraries may log
    after it: stderr shares the file)."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            found: dict[str, Any] = json.loads(line)
            return found
    raise RuntimeError(f"no JSON result in:\n{output[-4000:]}")


# --- an engine behind a real HTTP server -------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def serve(settings: Settings, extractor: Any) -> tuple[Any, asyncio.Task[None], str]:
    """``extractor`` behind hsx's app in a uvicorn server on this loop:
    ``(server, its task, URL)``; stop it with ``server.should_exit = True; await task``."""
    import uvicorn

    from service.api.app import create_app

    app = create_app(settings, extractor=extractor)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers a flag, not an event)
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


def bench_settings(
    scratch: Path,
    name: str,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    eager: bool = False,
    **limits: Any,
) -> Settings:
    """The tiny dense demo model (float32, 1 GiB KV cache; larger when asked) and
    storage under ``scratch``. ``eager``: no graph compilation (vLLM's CPU default
    compiles with inductor at start-up), as quick runs want."""
    from service.engine.tiny_models import make_model

    model = make_model(
        scratch / f"{name}-model", "llama", hidden_size=hidden_size, num_layers=num_layers
    )
    return Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 1024,
            "cpu_kvcache_space_gib": 1,
            **({"extra_args": {"enforce_eager": True}} if eager else {}),
        },
        storage={"url": str(scratch / f"{name}-objects")},
        limits={"max_prompts": 64, **limits},
    )


def prompt_lengths(count: int, seed: int) -> list[int]:
    """``count`` prompt lengths of 32-256 tokens: one distribution for every prompt set."""
    rng = random.Random(seed)
    return [rng.randrange(32, 257) for _ in range(count)]


def fresh_prompts(lengths: list[int], seed: int, salt: str = "") -> list[list[int]]:
    """Random token ids of these lengths. Every timed batch gets a set of its own: the
    engine caches prefixes, and a prompt seen before costs almost nothing, so a bench
    that repeats prompts measures overheads, not the work (a dataset does not repeat).
    Rows that share an engine pass a ``salt`` of their own: one seed alone would start
    their first prompts with the same tokens."""
    rng = random.Random(f"{salt}{seed}")
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


async def interleaved(
    first: Callable[[int], Awaitable[float]],
    second: Callable[[int], Awaitable[float]],
    rounds: int,
) -> tuple[float, float]:
    """Median seconds of each side over ``rounds`` rounds (after a warm-up of both), in
    ABBA order so neither side always runs right after the other; each call gets a
    seed of its own (fresh prompts)."""
    await first(-1)
    await second(-2)
    a, b = [], []
    for round_ in range(rounds):
        pair = (first, a), (second, b)
        for i, (side, times) in enumerate(pair if round_ % 2 == 0 else pair[::-1]):
            times.append(await side(1000 * round_ + i))
    return statistics.median(a), statistics.median(b)
