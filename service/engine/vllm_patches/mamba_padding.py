"""No placeholder drafts on a Mamba model's first prompt chunk (CPU).

Why this exists: with a speculative method (every hsx engine runs
``extract_hidden_states``, one speculative token), vLLM's ``Scheduler.schedule`` pads a
waiting request that has one token left to compute with placeholder drafts (``-1``), so
that its row has the ``1 + num_speculative_tokens`` rows of a decode and a step can
replay a uniform-decode CUDA graph. It does so whenever requests are already running in
the step and none of them is prefilling, also for a new request whose prompt is one
token. That row is a first prompt chunk, with no Mamba state before it, so vLLM's Mamba
metadata builder keeps it a prefill (``BaseMambaAttentionMetadataBuilder.
_compute_common_metadata``: only rows with prior state go the decode way, whose kernels
keep each row's state apart), and the prefill kernels store only the state after the
row's last token: the placeholder's. The placeholder is rejected, and every later step
of that request starts from a state that has taken in a token that is not in its
sequence. A one-token prompt sent while another request decoded generated from a
wrong state: its generated tokens' hidden states 0.7-1.6 relative error on Nemotron-H,
2e-3 to 4e-3 on Falcon-H1, and its tokens diverged from transformers' greedy ones; its
prompt token, the padded row's first, was exact. vLLM 0.32 and 0.33 alike (the padding
and the builder are the same code in both; not CPU code).

``install()`` wraps ``Scheduler.schedule`` in the EngineCore, for a model with Mamba
layers: after vLLM scheduled a step, a new request whose first chunk was padded gets
its placeholders taken back before the step goes to the workers (its one token, no
drafts), and the counts ``_update_after_schedule`` advanced by them are set back, so
the step is the one vLLM schedules with no padding. The placeholder would have been
rejected, so the request's tokens and accounting are what they would have been; a
row that has Mamba state before it (a prompt's last token after a transfer) keeps
vLLM's padding, which its decode path handles. A correctness patch: where the
scheduler, the count update or the Mamba builder is not what this was checked
against, ``hsx serve`` stops at start-up naming it.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from service.engine.vllm_patches.fingerprints import Digest
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint, applies

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
PATCH = TouchPoint(
    name="unpadded-first-mamba-chunks",
    kind=Kind.CORRECTNESS,
    hsx="service/engine/vllm_patches/mamba_padding.py",
    target="wraps vllm.v1.core.sched.scheduler.Scheduler.schedule: takes back the "
    "placeholder drafts it pads a new one-token prompt with, on a model with Mamba layers",
    why="the Mamba prefill of a padded first chunk stores the state after the "
    "placeholder: a 1-token prompt scheduled beside decoding requests generated from "
    "a wrong state (0.7-1.6 relative error on Nemotron-H)",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Digest(
            f"{_SCHEDULER}.schedule",
            {"0.32.0": "009ad1863ece7ac5", "0.33.0": "67146810ac4103fc"},
        ),
        Digest(
            f"{_SCHEDULER}._update_after_schedule",
            {"0.32.0": "008f67ef987c7088", "0.33.0": "008f67ef987c7088"},
        ),
        Digest(
            "vllm.v1.attention.backends.mamba_attn:"
            "BaseMambaAttentionMetadataBuilder._compute_common_metadata",
            {"0.32.0": "bdc8a44aa16c0420", "0.33.0": "bdc8a44aa16c0420"},
        ),
    ),
    notes={
        "0.33.0": "schedule() gained prefill cadence, draft skipping (skip_drafts) and "
        "encoder input updates; the padding of a waiting one-token request, the "
        "output's fields this sets back and _update_after_schedule are unchanged"
    },
)


def take_back_first_chunk_padding(scheduler: Any, output: SchedulerOutput) -> list[str]:
    """Undo the placeholder drafts ``Scheduler.schedule`` padded a new request's first
    prompt chunk with, in ``output`` and in the scheduler's requests; return their ids.

    A padded row is a new request (``scheduled_new_reqs``) with no computed token
    before this step and drafts that are all placeholders (``-1``; a real draft is a
    token id). ``_update_after_schedule`` has already added its scheduled tokens to the
    request's computed and in-flight counts, so those go back by the same number.
    """
    taken: list[str] = []
    for new in output.scheduled_new_reqs:
        drafts = output.scheduled_spec_decode_tokens.get(new.req_id)
        if not drafts or new.num_computed_tokens != 0 or any(t != -1 for t in drafts):
            continue
        extra = len(drafts)
        del output.scheduled_spec_decode_tokens[new.req_id]
        output.num_scheduled_tokens[new.req_id] -= extra
        output.total_num_scheduled_tokens -= extra
        request = scheduler.requests[new.req_id]
        request.num_computed_tokens -= extra
        request.num_in_flight_tokens -= extra
        taken.append(new.req_id)
    return taken


def has_mamba_layers(kv_cache_config: KVCacheConfig) -> bool:
    """Whether any KV-cache group holds Mamba-type state (Mamba, GatedDeltaNet)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)


def install(kv_cache_config: KVCacheConfig) -> bool:
    """Wrap this process's ``Scheduler.schedule`` where ``PATCH`` applies (a CPU host)
    and the model has Mamba layers; idempotent. True if installed. Raises
    ``PatchTargetChanged`` where its target is not what it was checked against."""
    if not has_mamba_layers(kv_cache_config) or not applies(PATCH):
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule
    if getattr(original, "hsx_unpads_first_mamba_chunks", False):
        return True

    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = original(self, *args, **kwargs)
        # Async scheduling (off on every CPU host) also counts output placeholders.
        if not self.scheduler_config.async_scheduling:
            take_back_first_chunk_padding(self, output)
        return output

    schedule.hsx_unpads_first_mamba_chunks = True  # type: ignore[attr-defined]
    Scheduler.schedule = schedule
    log.info("hsx: no placeholder drafts on a first Mamba prompt chunk")
    return True
