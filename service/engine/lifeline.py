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
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
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
