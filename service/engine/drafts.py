"""The EngineCore skips fetching draft tokens that no request would take.

Every hsx engine runs vLLM's ``extract_hidden_states`` speculative method, for which
vLLM 0.32 turns async scheduling off (on every host), so each engine step ends in
``EngineCore.post_step``, which asks the workers for the step's draft tokens
(``take_draft_token_ids``: one round trip on vLLM's queues) and hands them to
``Scheduler.update_draft_token_ids``.
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
stock engine in the same host is left as vLLM ships it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request


def drafts_wanted(running: Iterable[Request]) -> bool:
    """Whether ``Scheduler.update_draft_token_ids`` (vLLM 0.32) could change any of
    these requests: one that has not finished and is past its prefill takes new drafts,
    one still in its prefill only loses drafts it holds."""
    return any(
        not request.is_finished() and (not request.is_prefill_chunk or request.spec_token_ids)
        for request in running
    )


def skip_unused_draft_fetches() -> None:
    """Make this process's ``EngineCore.post_step`` fetch a step's drafts only where a
    request of ``Scheduler.running`` could take them. Idempotent."""
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
