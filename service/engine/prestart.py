"""Start vLLM's engine processes from a fork server that has imported vLLM once (CPU).

vLLM's CPU platform starts its EngineCore, and the EngineCore each worker, with
``spawn`` (``vllm/platforms/cpu.py`` forces it), and a spawned process imports vLLM
again before it does anything: 7-9 s of one core per process on this project's CI
machine, two processes per engine. ``multiprocessing``'s ``forkserver`` start method
keeps one server process that imports vLLM once (``PRELOAD``); each engine process is
forked from it already imported and then starts exactly as a spawned one does: it
unpickles its process object and runs it, with nothing of its parent's memory. The
server never runs a forward pass, so no OpenMP pool exists to be broken by the fork.

A spawned child takes three things from its parent at the moment it starts that a
fork server's child would take from the server instead; ``PreloadedProcess`` carries
them over:

- the environment: vLLM and hsx set variables (the OpenMP binding, the data-parallel
  rank's devices) just before they start a process; the OpenMP runtime read its own
  in the server, so the thread count and binding they name are applied in the child
  (``service.engine.openmp``);
- standard output and error: a supervisor's or pytest's redirection may have changed
  since the server started;
- the server itself: Python 3.11 would start a new, empty fork server in a fork
  server's child, so the EngineCore would start its worker the slow way again.

Only where vLLM chose ``spawn``; a ``fork`` vLLM chose (GPU, CUDA not initialised) is
left as it is. ``EngineSettings.preload_engine_processes`` turns it off.

``multiprocessing`` launches its fork server as a fresh interpreter, which imports vLLM
once more (7-9 s of a core). ``hsx serve`` has imported vLLM itself by the time it
starts uvicorn, and has run no forward pass and no other Python thread yet: there
``fork_server_here`` forks the server from the serving process instead, so it imports
only what the API did not (about 1 s). Everywhere else (a test process, a benchmark that
ran torch before) the server is launched fresh, as ``multiprocessing`` does.

The processes started this way can also poll vLLM's shared-memory queues without
spinning (``QueuePolling``, ``EngineSettings.cpu_poll_interval_us`` and
``cpu_poll_spin_us``): after each read, a reader of vLLM's ``MessageQueue`` (the worker
waiting for the next step, the EngineCore waiting for its result) polls the queue's
flag for one second, calling ``sched_yield`` between polls. On a CPU host the waiting
process is runnable all that time and takes its turn on the cores the forward pass
needs (vLLM #28836: 100% CPU); a sleep between polls gives them back. But a sleep also
delays every answer that comes within microseconds: one engine step is three round
trips (``execute_model``, ``sample_tokens`` and, with a speculative method,
``take_draft_token_ids``), and the worker's next step comes about a millisecond after
its last answer. So each wait keeps vLLM's spin for its first ``spin_s`` and sleeps
``pause_s`` between polls after that: the quick answers are caught spinning, the wait
through a forward pass sleeps. The one-second window and its shared-memory flag stay as
they are: only the pause between two looks changes, so no wake-up depends on vLLM's
ZeroMQ notification, which its conflated, HWM-1 socket can drop (a window of zero,
tried, stalled a run for a minute).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import socket
import stat
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, forkserver, reduction, resource_tracker, util
from multiprocessing.context import BaseContext, ForkServerContext, ForkServerProcess
from typing import TYPE_CHECKING, Any

from service.engine.openmp import take_openmp_settings

if TYPE_CHECKING:
    from service.config import EngineSettings

#: What the fork server imports once: everything an EngineCore and a CPU worker import
#: when they unpickle their targets, and hsx's classes that vLLM loads into them.
PRELOAD = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "service.engine.connector",
    "service.engine.introspect",
)

#: vLLM's modules that took ``get_mp_context`` by name at import (vLLM 0.32), so each
#: needs its own reference replaced.
VLLM_STARTERS = (
    "vllm.utils.system_utils",
    "vllm.v1.engine.utils",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.engine.coordinator",
)

_STDIO = (1, 2)


@dataclass(frozen=True)
class QueuePolling:
    """How the processes started from the fork server wait on vLLM's shared-memory
    queues within vLLM's one-second busy window after each read."""

    #: The sleep between two polls once ``spin_s`` has passed (0: vLLM's ``sched_yield``
    #: throughout, as shipped).
    pause_s: float = 0.0
    #: How long each wait (from its first poll after a read) keeps vLLM's spin before it
    #: sleeps; 0: it sleeps from the first poll.
    spin_s: float = 0.0

    @classmethod
    def of(cls, engine: EngineSettings) -> QueuePolling:
        """An engine's settings' polling (``cpu_poll_interval_us``, ``cpu_poll_spin_us``)."""
        return cls(engine.cpu_poll_interval_us / 1e6, engine.cpu_poll_spin_us / 1e6)


#: How the processes started from here poll; set by the last ``use_preloaded_processes``.
_polling = QueuePolling()


class PreloadedProcess(ForkServerProcess):
    """A fork-server process that starts with its parent's environment and standard
    output and error, as a spawned one would, and starts its own children from the
    same server."""

    _environ: dict[str, str]
    _stdio: tuple[Any, ...]
    _polling: QueuePolling

    def start(self) -> None:
        self._environ = dict(os.environ)
        self._polling = _polling
        super().start()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled only while the fork server's Popen sends this object: DupFd then
        # hands the descriptors to the child with it.
        state = self.__dict__.copy()
        state["_stdio"] = tuple(reduction.DupFd(fd) for fd in _STDIO)
        return state

    def run(self) -> None:
        _adopt_parent(self._environ, self._stdio, self._polling)
        super().run()


class PreloadedContext(ForkServerContext):
    """``multiprocessing``'s fork-server context, starting ``PreloadedProcess``es."""

    Process = PreloadedProcess


@functools.cache
def preloaded_context() -> PreloadedContext:
    """The one context of this process (the fork server is per process anyway)."""
    context = PreloadedContext()
    context.set_forkserver_preload(list(PRELOAD))
    return context


def use_preloaded_processes(polling: QueuePolling = QueuePolling()) -> None:
    """On CPU, make vLLM start the processes it would spawn from the preloaded fork
    server (for the rest of this process's life). Idempotent; called where an engine
    starts and again in each process it starts. Nothing on a GPU host: there vLLM
    spawns only once CUDA is initialised, and the server must not import vLLM's CUDA
    side for nothing.

    ``polling``: how the processes started from now on, and theirs, wait on vLLM's
    queues (the default: vLLM's own ``sched_yield`` spin; see the module's docstring).
    Each call sets it, so a stock engine started after an hsx one in the same process
    spins as vLLM does."""
    from service.engine.builder import on_cpu

    if not on_cpu():
        return
    global _polling
    _polling = polling
    context = preloaded_context()
    for name in VLLM_STARTERS:
        module: Any = importlib.import_module(name)
        original = module.get_mp_context
        if not getattr(original, "hsx_preloaded", False):
            module.get_mp_context = _instead_of_spawn(original, context)


def fork_server_here() -> bool:
    """Start this process's fork server by forking this process, which has imported
    vLLM already, rather than launching a fresh interpreter that imports it again.

    Call it where an engine is about to start and this process has run no forward pass
    (OpenMP's thread pool does not survive a fork; ``hsx serve`` before uvicorn). True
    when the server was forked; False, and nothing changed, off CPU (vLLM forks its
    engine processes there and needs no server), when a server runs already, or while a
    Python thread other than an idle pool worker runs here (it could hold a lock the
    server would inherit held), or when the fork itself fails; the server is then
    launched fresh when the first engine process starts."""
    from service.engine.builder import on_cpu

    server: Any = forkserver._forkserver
    if server._forkserver_pid is not None or server._forkserver_alive_fd is not None:
        return False
    if not on_cpu() or not _only_idle_pool_threads():
        return False
    resource_tracker.ensure_running()  # before the fork: the server's children share it
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        util._flush_std_streams()  # type: ignore[attr-defined]  # else written again by each child
        try:
            pid = os.fork()
        except OSError:  # no memory or processes left to fork: launch it fresh later
            os.close(alive_r)
            os.close(alive_w)
            return False
        if pid == 0:  # pragma: no cover - the server process; it never returns
            _serve_forks(listener.fileno(), alive_r, alive_w)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _only_idle_pool_threads() -> bool:
    """Whether every other Python thread is an idle ``ThreadPoolExecutor`` worker
    (``hsx serve``'s storage check leaves its pool's): blocked on its empty queue, it
    holds no lock that a forked child would inherit held."""
    from concurrent.futures import thread as pool

    for thread in threading.enumerate():
        if thread is threading.current_thread():
            continue
        target: Any = getattr(thread, "_target", None)
        args: Any = getattr(thread, "_args", ())
        if target is not pool._worker or len(args) < 2:
            return False
        executor: Any = args[0]()
        if executor is None or not args[1].empty():
            return False
        if executor._idle_semaphore._value < len(executor._threads):  # a task is running
            return False
        # Inside ``_worker`` itself (waiting in ``work_queue.get``), not in a call it
        # makes: ``_idle_semaphore.release()`` holds the semaphore's lock for a moment.
        frame = sys._current_frames().get(thread.ident or 0)
        if frame is None or frame.f_code is not pool._worker.__code__:
            return False
    return threading.current_thread() is threading.main_thread()


def _serve_forks(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server: drop what belongs to the serving process, then run
    ``multiprocessing``'s fork server loop until every client is gone. Never returns;
    ``os._exit``, so none of the serving process's exit handlers (nor its ``except``
    clauses, which would close its storage) run here."""
    code = 1
    try:
        os.close(alive_w)
        _drop_sockets(keep=listener_fd)
        _title_server()
        # A spawned engine process starts with logging as Python leaves it: no root
        # handler, root at WARNING, warnings not captured. hsx serve's console and
        # debug-log handlers stay the serving process's (vLLM's own loggers are set up
        # from VLLM_LOGGING_CONFIG_PATH either way).
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
        logging.root.setLevel(logging.WARNING)
        logging.captureWarnings(False)
        forkserver.main(listener_fd, alive_r, list(PRELOAD))
    except SystemExit:  # every client has gone: the normal end
        code = 0
    except BaseException:  # standard error is the debug log under hsx serve
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


#: The forked server's process title: ``ps`` would show a second ``hsx serve`` otherwise.
SERVER_TITLE = "hsx::EngineForkServer"


def _title_server() -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(SERVER_TITLE)


def _drop_sockets(keep: int) -> None:
    """Point every inherited socket but ``keep`` at /dev/null: the server and every
    engine process forked from it must not hold the API's listening port (a restart
    would find it in use) or its storage connections. The descriptors stay taken, so
    a Python object still holding one never closes a reused number."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in (keep, null):
                continue
            try:
                is_socket = stat.S_ISSOCK(os.fstat(fd).st_mode)
            except OSError:  # the directory listing's own descriptor, already closed
                continue
            if is_socket:
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _instead_of_spawn(original: Callable[[], BaseContext], context: BaseContext) -> Any:
    @functools.wraps(original)
    def get_mp_context() -> BaseContext:
        chosen = original()  # vLLM's own choice, with its reasons and logs
        return context if chosen.get_start_method() == "spawn" else chosen

    get_mp_context.hsx_preloaded = True  # type: ignore[attr-defined]
    return get_mp_context


def _adopt_parent(environ: dict[str, str], stdio: tuple[Any, ...], polling: QueuePolling) -> None:
    """In the child, before its target runs: the parent's environment (with the OpenMP
    thread count and binding it asks for) and output, the inherited fork server for any
    children, vLLM's starts routed to it again, and the parent's queue polling (here and
    in this process's children)."""
    _ready_process_title()
    os.environ.clear()
    os.environ.update(environ)
    # The OpenMP runtime read its variables in the server, before vLLM set this
    # worker's: apply them now, before any parallel region (service/engine/openmp.py).
    take_openmp_settings(environ)
    for target, inherited in zip(_STDIO, stdio, strict=True):
        fd = inherited.detach()
        os.dup2(fd, target)
        os.close(fd)
    server: Any = forkserver._forkserver
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
        # The server that forked this process is running (this process holds its
        # liveness pipe); Python 3.11 only knows a server it launched itself.
        server.ensure_running = resource_tracker.ensure_running
    use_preloaded_processes(polling)
    if polling.pause_s > 0:
        _pause_between_polls(polling)


def _pause_between_polls(polling: QueuePolling) -> None:
    """Make this process's vLLM queues sleep ``polling.pause_s`` between two polls
    instead of calling ``sched_yield``: ``shm_broadcast`` took vLLM's ``sched_yield`` by
    name, and its readers (``SpinCondition.wait``) and writers (``acquire_write``, a
    full ring) call nothing else while they wait. Readers keep the spin for the first
    ``polling.spin_s`` of each wait (``_spin_then_pause``)."""
    import time

    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    def pause() -> None:
        time.sleep(polling.pause_s)

    shm_broadcast.sched_yield = pause
    if polling.spin_s > 0:
        condition = shm_broadcast.SpinCondition
        condition.wait = _spin_then_pause(condition.wait, utils.sched_yield, polling)


def _spin_then_pause(
    idle_wait: Callable[..., None], spin: Callable[[], None], polling: QueuePolling
) -> Callable[..., None]:
    """``SpinCondition.wait`` as vLLM 0.32 has it (``spin`` between polls for a second
    after each read, then ``idle_wait``, its wait for the notification), except that
    after the wait's first ``polling.spin_s`` it sleeps ``polling.pause_s`` instead of
    spinning. A wait begins at its first poll after a read (``last_read`` changed)."""
    import time

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        now = time.monotonic()
        if now > self.last_read + self.busy_loop_s:
            idle_wait(self, timeout_ms)
            return
        if getattr(self, "_hsx_wait_after", None) != self.last_read:
            self._hsx_wait_after = self.last_read
            self._hsx_wait_began = now
        if now - self._hsx_wait_began < polling.spin_s:
            spin()
        else:
            time.sleep(polling.pause_s)

    return wait


def _ready_process_title() -> None:
    """Let ``setproctitle`` find this process's argv while ``environ`` still points
    into the block after it: it locates argv from there, and once the environment is
    replaced below it cannot, and vLLM's ``VLLM::EngineCore``/``VLLM::Worker`` titles
    (which operators and ``benchmarks/limits_bench.py`` look for) silently stay unset."""
    try:
        import setproctitle
    except ImportError:  # vLLM does without titles then, too
        return
    setproctitle.getproctitle()
