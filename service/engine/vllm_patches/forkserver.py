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
  (``openmp``);
- standard output and error: a supervisor's or pytest's redirection may have changed
  since the server started;
- the server itself: Python 3.11 would start a new, empty fork server in a fork
  server's child, so the EngineCore would start its worker the slow way again.

With them go the parent's queue polling (``polling``) and its checks of hsx's patches
(``registry.snapshot``), so a child does not read vLLM's source again.

Only where vLLM chose ``spawn`` (``mp_context``); a ``fork`` vLLM chose (GPU, CUDA not
initialised) is left as it is. ``EngineSettings.preload_engine_processes`` turns it off.

``multiprocessing`` launches its fork server as a fresh interpreter, which imports vLLM
once more (7-9 s of a core). ``hsx serve`` has imported vLLM itself by the time it
starts uvicorn, and has run no forward pass and no other Python thread yet: there
``fork_server_here`` forks the server from the serving process instead, so it imports
only what the API did not (about 1 s). Everywhere else (a test process, a benchmark that
ran torch before) the server is launched fresh, as ``multiprocessing`` does.

All of it leans on CPython's private fork-server state (``PATCH``), so it is a
performance patch of CPython's own: where those names are not what it was checked
against, vLLM's processes are spawned as vLLM does it.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
import traceback
from multiprocessing import forkserver
from typing import Any

from service.engine.vllm_patches.fingerprints import ALL_PRESENT, Names, Params
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint

#: What the fork server imports once: everything an EngineCore and a CPU worker import
#: when they unpickle their targets, and hsx's classes that vLLM loads into them.
PRELOAD = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "service.engine.connector",
    "service.engine.introspect",
)

_PRESENT = {"3.11": ALL_PRESENT, "3.12": ALL_PRESENT}
PATCH = TouchPoint(
    name="cpython-fork-server",
    kind=Kind.PERFORMANCE,
    hsx="service/engine/vllm_patches/forkserver.py",
    target="sets CPython's private fork-server state (multiprocessing.forkserver."
    "_forkserver) to a server forked from hsx serve, and runs its main loop",
    why="a fork server forked from the serving process imports about 1 s of modules "
    "instead of all of vLLM again (7-9 s of a core); its children find it again",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Names(
            "multiprocessing.forkserver",
            _PRESENT,
            "python",
            (
                "_forkserver",
                "ForkServer._forkserver_pid",
                "ForkServer._forkserver_alive_fd",
                "ForkServer._forkserver_address",
                "ForkServer.ensure_running",
            ),
        ),
        Params(
            "multiprocessing.forkserver:main",
            {v: "listener_fd, alive_r, preload, main_path, sys_path" for v in _PRESENT},
            "python",
        ),
        Names(
            "multiprocessing.util",
            _PRESENT,
            "python",
            ("_flush_std_streams", "is_abstract_socket_namespace"),
        ),
        Names("multiprocessing.connection", _PRESENT, "python", ("arbitrary_address",)),
        Names(
            "concurrent.futures.thread",
            _PRESENT,
            "python",
            ("_worker", "ThreadPoolExecutor._idle_semaphore", "ThreadPoolExecutor._threads"),
        ),
    ),
)


def only_idle_pool_threads() -> bool:
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


def serve_forks(listener_fd: int, alive_r: int, alive_w: int) -> None:
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


def ready_process_title() -> None:
    """Let ``setproctitle`` find this process's argv while ``environ`` still points
    into the block after it: it locates argv from there, and once the environment is
    replaced below it cannot, and vLLM's ``VLLM::EngineCore``/``VLLM::Worker`` titles
    (which operators look for) silently stay unset."""
    try:
        import setproctitle
    except ImportError:  # vLLM does without titles then, too
        return
    setproctitle.getproctitle()
