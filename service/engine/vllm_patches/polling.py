"""Waiting on vLLM's shared-memory queues without taking the forward pass's cores (CPU).

After each read, a reader of vLLM's ``MessageQueue`` (the worker waiting for the next
step, the EngineCore waiting for its result) polls the queue's flag for one second,
calling ``sched_yield`` between polls. On a CPU host the waiting process is runnable all
that time and takes its turn on the cores the forward pass needs (vLLM #28836: 100%
CPU); a sleep between polls gives them back. But a sleep also delays every answer that
comes within microseconds: one engine step is three round trips (``execute_model``,
``sample_tokens`` and, with a speculative method, ``take_draft_token_ids``), and the
worker's next step comes about a millisecond after its last answer. So each wait keeps
vLLM's spin for its first ``spin_s`` and sleeps ``pause_s`` between polls after that:
the quick answers are caught spinning, the wait through a forward pass sleeps. The
one-second window and its shared-memory flag stay as they are: only the pause between
two looks changes, so no wake-up depends on vLLM's ZeroMQ notification, which its
conflated, HWM-1 socket can drop (a window of zero, tried, stalled a run for a minute).

Two performance patches, installed in the processes started from hsx's fork server
(``forkserver``): ``PAUSE`` replaces the ``sched_yield`` that ``shm_broadcast`` calls,
``SPIN_THEN_PAUSE`` re-implements ``SpinCondition.wait``. Each is left off, with a
warning, where its target is not the code it was checked against.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine.vllm_patches.fingerprints import Calls, Digest
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint, applies

if TYPE_CHECKING:
    from service.config import EngineSettings

_SHM = "vllm.distributed.device_communicators.shm_broadcast"
PAUSE = TouchPoint(
    name="shm-queue-pause",
    kind=Kind.PERFORMANCE,
    hsx="service/engine/vllm_patches/polling.py",
    target=f"replaces {_SHM}.sched_yield (vllm.distributed.utils.sched_yield, taken by "
    "name) with a sleep of engine.cpu_poll_interval_us",
    why="vLLM's readers and writers spin with sched_yield for a second after each read, "
    "taking the cores of the forward pass on CPU (vLLM #28836)",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Calls(
            f"{_SHM}:sched_yield",
            dict.fromkeys(
                ("0.32.0", "0.33.0"), "MessageQueue.acquire_write: 0; SpinCondition.wait: 0"
            ),
        ),
    ),
)
SPIN_THEN_PAUSE = TouchPoint(
    name="shm-spin-then-pause",
    kind=Kind.PERFORMANCE,
    hsx="service/engine/vllm_patches/polling.py",
    target=f"re-implements {_SHM}.SpinCondition.wait",
    why="keeps vLLM's spin for the first engine.cpu_poll_spin_us of each wait, so the "
    "answers that come within a millisecond are not delayed by a sleep",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Digest(
            f"{_SHM}:SpinCondition.wait",
            {"0.32.0": "135115d7079fc080", "0.33.0": "135115d7079fc080"},
        ),
    ),
    requires=(PAUSE,),
)


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


#: How the processes started from the fork server poll; set by the last ``choose``.
_current = QueuePolling()


def choose(polling: QueuePolling) -> None:
    """Make ``polling`` the one the processes started from now on take."""
    global _current
    _current = polling


def current() -> QueuePolling:
    """The polling the processes started now take (``choose``)."""
    return _current


def pause_between_polls(polling: QueuePolling) -> None:
    """Make this process's vLLM queues sleep ``polling.pause_s`` between two polls
    instead of calling ``sched_yield``, where ``PAUSE`` applies: ``shm_broadcast`` took
    vLLM's ``sched_yield`` by name, and its readers (``SpinCondition.wait``) and writers
    (``acquire_write``, a full ring) call nothing else while they wait. Readers keep the
    spin for the first ``polling.spin_s`` of each wait (``spin_then_pause``), where
    ``SPIN_THEN_PAUSE`` applies."""
    if polling.pause_s <= 0 or not applies(PAUSE):
        return
    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    def pause() -> None:
        time.sleep(polling.pause_s)

    shm_broadcast.sched_yield = pause
    if polling.spin_s > 0 and applies(SPIN_THEN_PAUSE):
        condition = shm_broadcast.SpinCondition
        condition.wait = spin_then_pause(condition.wait, utils.sched_yield, polling)


def spin_then_pause(
    idle_wait: Callable[..., None], spin: Callable[[], None], polling: QueuePolling
) -> Callable[..., None]:
    """``SpinCondition.wait`` as vLLM 0.32 and 0.33 have it (``spin`` between polls for
    a second after each read, then ``idle_wait``, its wait for the notification), except
    that after the wait's first ``polling.spin_s`` it sleeps ``polling.pause_s`` instead
    of spinning. A wait begins at its first poll after a read (``last_read`` changed)."""

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
