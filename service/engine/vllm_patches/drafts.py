"""The EngineCore skips fetching draft tokens that no request would take (CPU only).

Every hsx engine runs vLLM's ``extract_hidden_states`` speculative method. On a CPU
host vLLM turns async scheduling off (``platforms/cpu.py`` does, for every method), so
each engine step ends in ``EngineCore.post_step``, which asks the workers for the step's
draft tokens (``take_draft_token_ids``: one round trip on vLLM's queues) and hands them
to ``Scheduler.update_draft_token_ids``. On a GPU host vLLM 0.32 and 0.33 schedule
asynchronously by default (``extract_hidden_states`` is one of the EAGLE methods that
async scheduling supports), the workers keep the drafts themselves and ``post_step``
fetches nothing: there is nothing to skip, so the patch is declared for CPU only and
never installed on a GPU host (not run on GPU).
That update passes over every request that has finished, and of a request still in its
prefill only clears drafts left from before. Most of hsx's requests finish in the step
that ends their prompt (``max_tokens=1``), so most of those round trips feed an update
that changes nothing; on a CPU host one costs about a millisecond of the EngineCore's
time between two steps (docs/cpu.md).

The draft tokens of a step belong to the requests scheduled in it (the worker's batch),
and every one of those still unfinished after the step is in ``Scheduler.running``. So
when none of ``running`` could take a draft, the fetch is skipped and the scheduler's
state is what the update would have left; otherwise vLLM's ``post_step`` runs as it
is. The worker keeps nothing for a fetch that does not come: its next step overwrites
the drafts. Installed in the EngineCore by hsx's connector (its scheduler half), so a
stock engine in the same host is left as vLLM ships it; left off, with a warning, where
``post_step`` or the update it mirrors is not the code this was checked against.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from service.engine.vllm_patches.fingerprints import Digest
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint, applies

if TYPE_CHECKING:
    from vllm.v1.request import Request

PATCH = TouchPoint(
    name="skip-unused-draft-fetches",
    kind=Kind.PERFORMANCE,
    hsx="service/engine/vllm_patches/drafts.py",
    target="replaces vllm.v1.engine.core.EngineCore.post_step; mirrors "
    "Scheduler.update_draft_token_ids",
    why="a step whose requests all finished with their prompt fetches drafts nothing "
    "takes: a round trip to the workers (about 1 ms of the EngineCore per step on CPU)",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Digest(
            "vllm.v1.engine.core:EngineCore.post_step",
            {"0.32.0": "ee5aa73f76019274", "0.33.0": "ee5aa73f76019274"},
        ),
        Digest(
            "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
            {"0.32.0": "7bd86744c68bccbf", "0.33.0": "7bd86744c68bccbf"},
        ),
    ),
)


def drafts_wanted(running: Iterable[Request]) -> bool:
    """Whether ``Scheduler.update_draft_token_ids`` (vLLM 0.32, 0.33) could change any of
    these requests: one that has not finished and is past its prefill takes new drafts,
    one still in its prefill only loses drafts it holds."""
    return any(
        not request.is_finished() and (not request.is_prefill_chunk or request.spec_token_ids)
        for request in running
    )


def skip_unused_draft_fetches() -> None:
    """Make this process's ``EngineCore.post_step`` fetch a step's drafts only where a
    request of ``Scheduler.running`` could take them, where ``PATCH`` applies (a CPU
    host, its target as checked). Idempotent."""
    if not applies(PATCH):
        return
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.post_step
    if getattr(original, "hsx_skips_unused_drafts", False):
        return

    @functools.wraps(original)
    def post_step(self: Any, model_executed: bool) -> None:
        running = getattr(self.scheduler, "running", None)
        if running is not None and not drafts_wanted(running):
            return
        original(self, model_executed)

    post_step.hsx_skips_unused_drafts = True  # type: ignore[attr-defined]
    EngineCore.post_step = post_step
