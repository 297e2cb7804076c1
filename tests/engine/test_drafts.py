"""The EngineCore fetches a step's draft tokens only where a request could take them.

No engine: vLLM's own ``Request`` in each state a request of ``Scheduler.running`` can
be in, vLLM's own ``Scheduler.update_draft_token_ids`` to say what the fetch would have
changed, and vLLM's own ``EngineCore.post_step`` with the skip installed, its executor
a recorder (the real one is a process: the engine tests run through it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

from service.engine.vllm_patches.drafts import drafts_wanted, skip_unused_draft_fetches


def request(name: str, state: str) -> Request:
    """A request as ``Scheduler.running`` holds it after a step, in ``state``."""
    made = Request(name, [5, 6, 7, 8], SamplingParams(max_tokens=4), None)
    made.status = RequestStatus.RUNNING
    if state == "finished":
        made.status = RequestStatus.FINISHED_LENGTH_CAPPED
    elif state in ("prefill", "prefill with drafts"):
        made.is_prefill_chunk = True
        made.spec_token_ids = [9] if state == "prefill with drafts" else []
    else:
        assert state == "decoding"
    return made


def update_changes(states: tuple[str, ...]) -> bool:
    """Whether vLLM's own update, handed one draft per request, changes any of them."""
    running = [request(f"r{n}", state) for n, state in enumerate(states)]
    scheduler: Any = SimpleNamespace(
        requests={r.request_id: r for r in running},
        structured_output_manager=SimpleNamespace(validate_tokens=lambda _r, ids: ids),
    )
    before = [list(r.spec_token_ids) for r in running]
    drafts = SimpleNamespace(
        req_ids=[r.request_id for r in running], draft_token_ids=[[42] for _ in running]
    )
    Scheduler.update_draft_token_ids(scheduler, drafts)  # type: ignore[arg-type]
    return [list(r.spec_token_ids) for r in running] != before


@pytest.mark.parametrize(
    "states",
    [
        (),
        ("finished",),
        ("prefill",),
        ("finished", "prefill", "finished"),
        ("prefill with drafts",),
        ("decoding",),
        ("finished", "decoding"),
        ("prefill", "prefill with drafts"),
    ],
)
def test_drafts_are_wanted_exactly_where_vllms_update_would_change_a_request(
    states: tuple[str, ...],
) -> None:
    running = [request(f"r{n}", state) for n, state in enumerate(states)]
    assert drafts_wanted(running) == update_changes(states)
    assert drafts_wanted(running) == any(s in ("decoding", "prefill with drafts") for s in states)


def test_post_step_fetches_drafts_only_for_a_request_that_could_take_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(EngineCore, "post_step", EngineCore.post_step)  # restored after
    skip_unused_draft_fetches()
    skip_unused_draft_fetches()  # idempotent: one wrapper, not two
    assert EngineCore.post_step.__wrapped__.__qualname__ == "EngineCore.post_step"  # type: ignore[attr-defined]
    fetched: list[str] = []

    def take_draft_token_ids() -> None:
        fetched.append("take")

    def engine(states: tuple[str, ...]) -> Any:
        running = [request(f"r{n}", state) for n, state in enumerate(states)]
        return SimpleNamespace(
            check_for_draft_tokens=True,
            async_scheduling=False,
            scheduler=SimpleNamespace(running=running),
            model_executor=SimpleNamespace(take_draft_token_ids=take_draft_token_ids),
        )

    for states, expected in [
        ((), []),
        (("finished", "prefill"), []),
        (("prefill", "decoding"), ["take"]),
        (("prefill with drafts",), ["take"]),
    ]:
        fetched.clear()
        EngineCore.post_step(engine(states), model_executed=True)
        assert fetched == expected, states
