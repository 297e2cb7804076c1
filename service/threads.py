"""Thread pools whose threads carry their names down to the OS.

Python names its threads for itself only: ``/proc/<pid>/task/<tid>/comm``, ``top -H``,
``perf`` and the benches' per-thread CPU (``benchmarks/peer_side.thread_seconds``) see
every thread under its process's name, so the writer's CPU could not be told from the
forward pass's. Linux keeps 15 bytes of a thread name; ours fit (``hsx-encode_0``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def name_os_thread() -> None:
    """Give the calling thread's Python name to the OS thread (first 15 bytes).

    Best effort: a name is for tools, so a missing ``setproctitle`` or a refusal leaves
    the thread as it was, never breaks the pool that calls this from its start-up hook.
    Threads that a named thread starts (libraries' own) inherit its name on Linux.
    """
    try:
        import setproctitle  # vLLM names its processes with it

        setproctitle.setthreadtitle(threading.current_thread().name)
    except (ImportError, OSError):
        pass


def named_pool(
    max_workers: int, prefix: str, initializer: Callable[[], None] | None = None
) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose threads (``<prefix>_<n>``) are named in the OS too;
    ``initializer`` runs after the naming, in each thread."""

    def start() -> None:
        name_os_thread()
        if initializer is not None:
            initializer()

    return ThreadPoolExecutor(max_workers, thread_name_prefix=prefix, initializer=start)
