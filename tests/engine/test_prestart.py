"""Engine processes started from the preloaded fork server behave as spawned ones do.

No engine: the real fork server (``service.engine.vllm_patches``) and small targets that
report what a vLLM process would rely on: the environment and output its parent had
when it started it (not when the server started), vLLM's process title, and a second
generation started from the same server.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import get_context
from pathlib import Path

import psutil
import pytest

from service.engine.builder import on_cpu
from service.engine.vllm_patches.forkserver import SERVER_TITLE
from service.engine.vllm_patches.mp_context import preloaded_context, use_preloaded_processes
from service.engine.vllm_patches.polling import QueuePolling, spin_then_pause
from tests.support.processes import wait_until

# The fork server imports vLLM in a process of its own (about 10 s): `make test`, not
# `make test-fast`.
pytestmark = pytest.mark.slow

VARIABLE = "HSX_TEST_PRESTART"


def report(path: str, generation: int) -> None:
    """Write what this process sees to ``path``; the first generation starts a second."""
    import setproctitle

    setproctitle.setproctitle(f"VLLM::Gen{generation}")
    me = psutil.Process()
    line = f"{generation} {os.environ.get(VARIABLE)} {me.name()} {me.ppid()}\n"
    with open(path, "a") as out:
        out.write(line)
    print(f"stdout of generation {generation}", flush=True)
    if generation == 1:
        child = preloaded_context().Process(target=report, args=(path, 2))
        child.start()
        child.join(60)
        sys.exit(child.exitcode)


@pytest.fixture
def server() -> int:
    """The fork server's pid, running (it starts with the first process)."""
    warm = preloaded_context().Process(target=int)
    warm.start()
    warm.join(120)
    assert warm.exitcode == 0
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert pid is not None
    return int(pid)


def test_children_take_the_parents_environment_output_and_server(
    tmp_path: Path, server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VARIABLE, "set after the server started")
    report_path, stdout_path = tmp_path / "report", tmp_path / "stdout"
    saved = os.dup(1)
    try:
        with stdout_path.open("wb") as sink:
            os.dup2(sink.fileno(), 1)  # as a supervisor's redirection would
            child = preloaded_context().Process(target=report, args=(str(report_path), 1))
            child.start()
            child.join(120)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert child.exitcode == 0
    lines = [line.split(" ", 1) for line in report_path.read_text().splitlines()]
    assert [generation for generation, _ in lines] == ["1", "2"]
    for generation, rest in lines:
        value, title, parent = rest.rsplit(" ", 2)
        assert value == "set after the server started"
        assert title == f"VLLM::Gen{generation}"  # vLLM's titles are set, not lost
        assert int(parent) == server  # both generations forked from the one server
    assert stdout_path.read_text().splitlines() == [
        "stdout of generation 1",
        "stdout of generation 2",
    ]


def test_vllm_spawns_from_the_server_and_keeps_its_other_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.utils import system_utils
    from vllm.v1.engine import utils as engine_utils

    monkeypatch.setattr(system_utils, "get_mp_context", lambda: get_context("spawn"))
    monkeypatch.setattr(engine_utils, "get_mp_context", lambda: get_context("fork"))
    use_preloaded_processes()
    use_preloaded_processes()  # idempotent: one wrapper, not two
    assert system_utils.get_mp_context() is preloaded_context()
    assert system_utils.get_mp_context.__wrapped__() is get_context("spawn")  # type: ignore[attr-defined]
    assert engine_utils.get_mp_context() is get_context("fork")  # a fork stays a fork


def poll_report(path: str, generation: int) -> None:
    """Write how 50 of vLLM's queue pauses behave here (wall and CPU seconds, and whether
    the function is vLLM's own); the first generation starts a second."""
    import time

    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(50):
        shm_broadcast.sched_yield()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    own = shm_broadcast.sched_yield is utils.sched_yield
    wait = shm_broadcast.SpinCondition.wait.__qualname__
    with open(path, "a") as out:
        out.write(f"{generation} {wall:.4f} {cpu:.4f} {own} {wait}\n")
    if generation == 1:
        child = preloaded_context().Process(target=poll_report, args=(path, 2))
        child.start()
        child.join(60)
        sys.exit(child.exitcode)


@pytest.mark.parametrize(
    ("interval_s", "spin_s"), [(0.002, 0.0), (0.002, 0.002), (0.0, 0.0), (0.0, 0.002)]
)
def test_engine_processes_sleep_between_polls_of_vllm_queues(
    tmp_path: Path, server: int, interval_s: float, spin_s: float
) -> None:
    """With an interval, both generations sleep it between polls (50 polls: at least
    50 intervals of wall time, almost no CPU), and with a spin window too their readers
    wait with ``spin_then_pause``; with no interval they keep vLLM's sched_yield and
    its wait, whatever the spin window."""
    report_path = tmp_path / "report"
    use_preloaded_processes(QueuePolling(interval_s, spin_s))
    try:
        child = preloaded_context().Process(target=poll_report, args=(str(report_path), 1))
        child.start()
        child.join(120)
    finally:
        use_preloaded_processes()
    assert child.exitcode == 0
    lines = [line.split() for line in report_path.read_text().splitlines()]
    assert [generation for generation, *_ in lines] == ["1", "2"]
    for _, wall, cpu, own, wait in lines:
        if interval_s:
            assert float(wall) >= 50 * interval_s
            assert float(cpu) < 0.25 * float(wall)
            assert own == "False"
        else:  # vLLM's own sched_yield (no sleep; its wall time is the host's load's)
            assert own == "True"
        spins_first = interval_s and spin_s
        assert wait == ("spin_then_pause.<locals>.wait" if spins_first else "SpinCondition.wait")


class Clock:
    """``time.monotonic`` and ``time.sleep`` for one thread: a sleep moves it on."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_each_wait_spins_first_then_sleeps_and_idles_after_vllms_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's real reader ``SpinCondition``: a wait that begins after a read spins for
    its first ``spin_s`` (vLLM's ``sched_yield``), then sleeps ``pause_s`` between
    polls; the next read starts the spin again; past vLLM's one-second busy window it
    waits for the notification as vLLM does. The clock is a fake one, so the test sees
    which branch each poll took, not how fast this machine is."""
    import time

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock.monotonic)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    context = zmq.Context()
    condition = SpinCondition(True, context, f"ipc://{tmp_path / 'notify'}")
    polls: list[str] = []

    def spin() -> None:
        polls.append("spin")
        clock.now += 2**-13  # powers of two: the clock's sums stay exact

    def idle(self: SpinCondition, timeout_ms: int | None = None) -> None:
        polls.append(f"idle {timeout_ms}")
        clock.now += 0.5

    wait = spin_then_pause(idle, spin, QueuePolling(pause_s=2**-11, spin_s=2**-9))
    try:
        condition.record_read()
        for _ in range(26):  # 16 spins fill the spin window, then 10 sleeps
            wait(condition)
        assert polls == ["spin"] * 16
        assert clock.sleeps == [2**-11] * 10
        condition.record_read()  # an answer came: the next wait spins again
        polls.clear()
        wait(condition)
        assert polls == ["spin"]
        clock.now = condition.last_read + 1.01  # past vLLM's busy window (1 s)
        wait(condition, 250)
        assert polls == ["spin", "idle 250"]
    finally:
        condition.local_notify_socket.close(0)
        condition.read_cancel_socket.close(0)
        condition.write_cancel_socket.close(0)
        context.term()


def openmp_report(path: str) -> None:
    """Run a parallel region, then write the OpenMP thread count and the CPUs every
    thread of this process may run on."""
    import json

    import torch

    torch.ones(512, 512) @ torch.ones(512, 512)  # the pool exists and has run
    each = [sorted(os.sched_getaffinity(int(task))) for task in os.listdir("/proc/self/task")]
    cpus = sorted({cpu for one in each for cpu in one})
    report = {"threads": torch.get_num_threads(), "cpus": cpus, "each": sorted(each)}
    Path(path).write_text(json.dumps(report))


def vllm_binding(cpus: list[int]) -> dict[str, str]:
    """What vLLM's executor sets for a worker bound to ``cpus`` with no OpenMP
    runtime preloaded (vllm/utils/ompmultiprocessing.py, ``configure_omp_envs``)."""
    return {
        "OMP_NUM_THREADS": str(len(cpus)),
        "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
        "OMP_PROC_BIND": "true",
    }


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind one")
@pytest.mark.parametrize("which", ["last", "first", "gomp list"])
def test_engine_processes_take_the_openmp_binding_set_after_the_server_loaded_openmp(
    tmp_path: Path, server: int, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """The server loaded OpenMP before vLLM set a worker's variables; the worker still
    runs the thread count they ask for, on the CPUs they name, one thread on each
    (a forked worker kept the server's: one thread per CPU, every thread on every CPU)."""
    import json

    allowed = sorted(os.sched_getaffinity(0))
    cpus = [allowed[-1]] if which == "last" else [allowed[0]]
    for name, value in vllm_binding(cpus).items():
        monkeypatch.setenv(name, value)
    if which == "gomp list":  # GNU OpenMP preloaded: vLLM names the CPUs one by one
        cpus = allowed[-2:]
        monkeypatch.delenv("OMP_PLACES")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setenv("GOMP_CPU_AFFINITY", " ".join(map(str, cpus)))
    report_path = tmp_path / "report"
    child = preloaded_context().Process(target=openmp_report, args=(str(report_path),))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    seen = json.loads(report_path.read_text())
    assert (seen["threads"], seen["cpus"]) == (len(cpus), cpus)
    # One compute thread on each CPU: a thread-by-thread list (what vLLM writes) pins
    # the main thread and the OpenMP team's one each; torch's pthreadpool thread (two
    # threads asked) keeps the process's binding. One CPU: every thread on it.
    alone = sorted(one[0] for one in seen["each"] if len(one) == 1)
    assert alone == cpus if len(cpus) > 1 else seen["each"] == [cpus]


# What ``hsx serve`` has done when it forks the server: imported vLLM, bound its port,
# and run its storage check on a thread pool whose worker now idles.
FORK_HERE = """
import json, socket, sys, threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import forkserver

import psutil

from service.engine.vllm_patches import mp_context as preloaded, mp_context
from tests.support.processes import describe_process

idle = sys.argv[2] == "idle"
if idle:  # what hsx serve has imported, and set up, when it forks (8 CPU-s)
    import vllm.v1.engine.async_llm

    mp_context.use_preloaded_processes()
port = socket.create_server(("127.0.0.1", 0))
pool = ThreadPoolExecutor(1)
pool.submit(int).result()
release = threading.Event()
if sys.argv[2] == "thread":
    threading.Thread(target=release.wait, daemon=True).start()
elif sys.argv[2] == "pool task":
    pool.submit(release.wait)
forked = [preloaded.fork_server_here(), preloaded.fork_server_here()]
context = preloaded.preloaded_context()
if not idle:
    # Refused, the server is launched fresh and imports its preload list: what the list
    # holds is not this test's matter (the module's other tests run the real one).
    context.set_forkserver_preload(["tests.support.processes"])
child = context.Process(target=describe_process, args=(sys.argv[1],))
child.start()
child.join(120)
release.set()
server = psutil.Process(forkserver._forkserver._forkserver_pid)
seen = json.loads(open(sys.argv[1]).read())
print(json.dumps({
    "forked": forked,
    "exitcode": child.exitcode,
    "from_server": seen["ppid"] == server.pid,
    "server": " ".join(server.cmdline()),
    "server_tcp": len(server.net_connections(kind="tcp")),
    "child_tcp": seen["tcp"],
    "own_tcp": len(psutil.Process().net_connections(kind="tcp")),
    "server_pid": server.pid,
}), flush=True)
"""


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.skipif(not on_cpu(), reason="the fork server is CPU-only (vLLM forks on a GPU)")
@pytest.mark.parametrize("threads", ["idle", "thread", "pool task"])
def test_serve_forks_the_server_from_itself_only_when_that_is_safe(
    tmp_path: Path, threads: str
) -> None:
    """With only an idle pool worker beside it, the process forks its fork server from
    itself (no fresh interpreter importing vLLM again), and neither the server nor the
    engine processes it forks hold the process's listening port. With another thread
    running, or a pool task, it does not fork, and the server is launched fresh as
    before. Either way the server exits with the process."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", FORK_HERE, str(tmp_path / "seen.json"), threads],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    idle = threads == "idle"
    assert result["forked"] == [idle, False]  # once, and never a second server
    assert result["exitcode"] == 0
    assert result["from_server"]
    # Forked, it carries its own title; launched fresh, multiprocessing's command line.
    assert (SERVER_TITLE in result["server"]) is idle
    assert ("multiprocessing.forkserver" in result["server"]) is not idle
    assert result["own_tcp"] == 1  # the port is the process's own ...
    assert result["server_tcp"] == 0  # ... never the server's
    assert result["child_tcp"] == 0  # nor an engine process's
    server = result["server_pid"]
    wait_until(lambda: not psutil.pid_exists(server), 10, "the fork server outlived its process")
