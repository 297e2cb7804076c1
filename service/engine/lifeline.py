"""End the EngineCore process when the process that started it is gone.

vLLM's workers watch a death pipe from their EngineCore, but the EngineCore itself
does not watch its own parent (vLLM 0.32): when ``hsx serve`` is killed with SIGKILL
(an OOM kill, a node drain past its grace period), the EngineCore and its worker live
on as orphans, holding memory and the KV cache, and a restarted server starts a second
engine beside them. ``multiprocessing`` gives every child it starts a sentinel that
becomes readable when the parent exits, whatever the start method; a daemon thread
waits on it and stops the engine the way a SIGTERM from the parent would, so its
workers are shut down by vLLM's own handler. ``PR_SET_PDEATHSIG`` is not used: it
fires when the parent *thread* that started the process exits, which need not be the
server's end.

Its other half, ``exit_without_a_heap_scan``, makes a clean exit quick: the engine's
processes skip Python's last full collection, which ran past the 5 s vLLM gives an
EngineCore to exit before it kills it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import wait

# After SIGTERM, how long vLLM's own shutdown may take before the process is killed.
GRACE_S = 10.0

# Under vLLM's logger: this runs in vLLM's process, where only vLLM's logging config
# reaches the server's console (hsx's own handlers live in the API process).
log = logging.getLogger(f"vllm.{__name__}")


def exit_with_parent(grace_s: float = GRACE_S) -> bool:
    """Start the watch in this process; False where it has no ``multiprocessing`` parent
    (an engine run in the caller's own process ends with it anyway)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    thread = threading.Thread(
        target=_watch, args=(parent.sentinel, grace_s), name="hsx-lifeline", daemon=True
    )
    thread.start()
    return True


def _watch(sentinel: int, grace_s: float) -> None:
    wait([sentinel])
    log.error("the process that started this engine is gone; shutting the engine down")
    os.kill(os.getpid(), signal.SIGTERM)
    # vLLM's handler raises SystemExit in the main thread; if that hangs, do not linger.
    threading.Event().wait(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_without_a_heap_scan() -> None:
    """Arrange (once per process) that an exit after a clean engine shutdown skips
    Python's last scan of the heap; ``shut_down_cleanly`` marks that shutdown.

    Python's finalisation runs a full collection over every tracked object: in a vLLM
    engine process (torch, vLLM and transformers imported, millions of objects) that
    is 2-3 s of one core, after vLLM's shutdown has undone its ``gc.freeze()``. The
    worker spent it before exiting and its EngineCore ran past the 5 s the API
    process's ``shutdown`` waits, so it was killed rather than left to finish. vLLM
    skips the scan the same way on ROCm (``EngineCoreProc.run_engine_core``); the exit
    gives the memory back. Frozen objects are never freed, so triton's nanobind
    bindings would report them as leaked on stderr: once the heap is frozen, the
    handler closes stderr, as nothing after a clean shutdown has anything to say there.
    The handler is registered early, so it runs after the handlers registered later.
    A process that exits without a clean shutdown (a crash) keeps Python's default, and
    so does an engine run in its caller's process (no ``multiprocessing`` parent).
    """
    global _REGISTERED
    if not _REGISTERED and multiprocessing.parent_process() is not None:
        _REGISTERED = True
        atexit.register(_freeze_if_clean)


def shut_down_cleanly() -> None:
    """Mark this process's engine shutdown as clean (``exit_without_a_heap_scan``)."""
    global _CLEAN
    _CLEAN = True


_REGISTERED = False
_CLEAN = False


def _freeze_if_clean() -> None:
    if not _CLEAN:
        return
    gc.freeze()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
