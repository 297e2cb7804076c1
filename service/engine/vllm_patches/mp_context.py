"""vLLM starts the processes it would spawn from hsx's preloaded fork server (CPU).

vLLM asks ``vllm.utils.system_utils.get_mp_context`` for the start method of every
process it starts (the EngineCore, its workers, the data-parallel coordinator). Four of
its modules took that function by name when they were imported, so each holds its own
reference, and each is replaced (``VLLM_STARTERS``; ``PATCH``'s fingerprint notices a
fifth). The replacement asks vLLM's own function first, keeping its choice, its reasons
and its logs, and swaps only a ``spawn`` for the preloaded fork server
(``forkserver``): a ``fork`` vLLM chose stays a fork.

The preloaded context and its processes live here too (``preloaded_context``,
``fork_server_here``): each process started from the server installs this patch again
before its target runs, so ``forkserver`` (CPython's fork-server mechanics) imports
nothing of this module.
"""

from __future__ import annotations

import functools
import importlib
import os
import socket
from collections.abc import Callable
from multiprocessing import connection, reduction, resource_tracker, util
from multiprocessing import forkserver as cpython_forkserver
from multiprocessing.context import BaseContext, ForkServerContext, ForkServerProcess
from typing import Any

from service.engine.vllm_patches import forkserver, openmp, polling, registry
from service.engine.vllm_patches.fingerprints import Binders, Digest
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint, applies

#: vLLM's modules that took ``get_mp_context`` by name at import (vLLM 0.32 and 0.33),
#: so each needs its own reference replaced.
VLLM_STARTERS = (
    "vllm.utils.system_utils",
    "vllm.v1.engine.utils",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.engine.coordinator",
)

PATCH = TouchPoint(
    name="preloaded-engine-processes",
    kind=Kind.PERFORMANCE,
    hsx="service/engine/vllm_patches/mp_context.py",
    target="replaces get_mp_context in " + ", ".join(VLLM_STARTERS),
    why="a spawned engine process imports vLLM again: 7-9 s of a core per process, two "
    "per engine; one forked from the preloaded server does not",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Binders(
            "get_mp_context", dict.fromkeys(("0.32.0", "0.33.0"), ", ".join(sorted(VLLM_STARTERS)))
        ),
        Digest(
            "vllm.utils.system_utils:get_mp_context",
            {"0.32.0": "b819b9726bab2661", "0.33.0": "ed69621a864a1248"},
        ),
    ),
    requires=(forkserver.PATCH, openmp.PATCH),
    notes={
        "0.33.0": "get_mp_context now pauses libgomp's threads before a fork; hsx swaps "
        "only a spawn, so it keeps that"
    },
)


def use_preloaded_processes(chosen: polling.QueuePolling | None = None) -> None:
    """Make vLLM start the processes it would spawn from the preloaded fork server (for
    the rest of this process's life), where ``PATCH`` applies: a CPU host (on a GPU
    host vLLM spawns only once CUDA is initialised, and the server must not import
    vLLM's CUDA side for nothing), its targets and those of the patches it builds on as
    checked. Idempotent; called where an engine starts and again in each process it
    starts.

    ``chosen``: how the processes started from now on, and theirs, wait on vLLM's
    queues (None: vLLM's own ``sched_yield`` spin; see ``polling``). Each call
    sets it, so a stock engine started after an hsx one in the same process spins as
    vLLM does."""
    if not applies(PATCH):
        return
    polling.choose(chosen or polling.QueuePolling())
    context = preloaded_context()
    for name in VLLM_STARTERS:
        module: Any = importlib.import_module(name)
        original = module.get_mp_context
        if not getattr(original, "hsx_preloaded", False):
            module.get_mp_context = _instead_of_spawn(original, context)


def _instead_of_spawn(original: Callable[[], BaseContext], context: BaseContext) -> Any:
    @functools.wraps(original)
    def get_mp_context() -> BaseContext:
        chosen = original()  # vLLM's own choice, with its reasons and logs
        return context if chosen.get_start_method() == "spawn" else chosen

    get_mp_context.hsx_preloaded = True  # type: ignore[attr-defined]
    return get_mp_context


_STDIO = (1, 2)


class PreloadedProcess(ForkServerProcess):
    """A fork-server process that starts with its parent's environment and standard
    output and error, as a spawned one would, and starts its own children from the
    same server."""

    _environ: dict[str, str]
    _stdio: tuple[Any, ...]
    _polling: polling.QueuePolling
    _checked: dict[str, str | None]

    def start(self) -> None:
        self._environ = dict(os.environ)
        self._polling = polling.current()
        self._checked = registry.snapshot()
        super().start()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled only while the fork server's Popen sends this object: DupFd then
        # hands the descriptors to the child with it.
        state = self.__dict__.copy()
        state["_stdio"] = tuple(reduction.DupFd(fd) for fd in _STDIO)
        return state

    def run(self) -> None:
        registry.adopt(self._checked)
        _adopt_parent(self._environ, self._stdio, self._polling)
        super().run()


class PreloadedContext(ForkServerContext):
    """``multiprocessing``'s fork-server context, starting ``PreloadedProcess``es."""

    Process = PreloadedProcess


@functools.cache
def preloaded_context() -> PreloadedContext:
    """The one context of this process (the fork server is per process anyway)."""
    context = PreloadedContext()
    context.set_forkserver_preload(list(forkserver.PRELOAD))
    return context


def fork_server_here() -> bool:
    """Start this process's fork server by forking this process, which has imported
    vLLM already, rather than launching a fresh interpreter that imports it again.

    Call it where an engine is about to start and this process has run no forward pass
    (OpenMP's thread pool does not survive a fork; ``hsx serve`` before uvicorn). True
    when the server was forked; False, and nothing changed, off CPU (vLLM forks its
    engine processes there and needs no server), where the preloaded processes' patches
    are left off (``PATCH``), when a server runs already, or while a
    Python thread other than an idle pool worker runs here (it could hold a lock the
    server would inherit held), or when the fork itself fails; the server is then
    launched fresh when the first engine process starts."""
    if not applies(PATCH):  # CPU only, CPython's names as checked
        return False
    server: Any = cpython_forkserver._forkserver
    if server._forkserver_pid is not None or server._forkserver_alive_fd is not None:
        return False
    if not forkserver.only_idle_pool_threads():
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
            forkserver.serve_forks(listener.fileno(), alive_r, alive_w)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _adopt_parent(
    environ: dict[str, str], stdio: tuple[Any, ...], chosen: polling.QueuePolling
) -> None:
    """In the child, before its target runs: the parent's environment (with the OpenMP
    thread count and binding it asks for) and output, the inherited fork server for any
    children, vLLM's starts routed to it again, and the parent's queue polling (here and
    in this process's children)."""
    forkserver.ready_process_title()
    os.environ.clear()
    os.environ.update(environ)
    # The OpenMP runtime read its variables in the server, before vLLM set this
    # worker's: apply them now, before any parallel region (openmp.py).
    openmp.take_openmp_settings(environ)
    for target, inherited in zip(_STDIO, stdio, strict=True):
        fd = inherited.detach()
        os.dup2(fd, target)
        os.close(fd)
    server: Any = cpython_forkserver._forkserver
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
        # The server that forked this process is running (this process holds its
        # liveness pipe); Python 3.11 only knows a server it launched itself.
        server.ensure_running = resource_tracker.ensure_running
    use_preloaded_processes(chosen)
    polling.pause_between_polls(chosen)
