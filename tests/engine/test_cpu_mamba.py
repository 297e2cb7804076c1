"""hsx's Mamba patches without an engine: our CPU conv update against a plain causal
convolution over the whole sequence, and the first prompt chunk's placeholder drafts
taken back from vLLM's own scheduler output, counted by vLLM's own count update (the
engine tests run both through the engine: tests/engine/test_hybrid_s3.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from service.engine.vllm_patches.cpu_mamba import causal_conv1d_update_spec
from service.engine.vllm_patches.mamba_padding import take_back_first_chunk_padding

WIDTH, DIM = 4, 6


def full_conv(tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """silu(causal conv) over [dim, n] from a zero history: the value every token must get."""
    padded = torch.cat([torch.zeros(DIM, WIDTH - 1), tokens], dim=-1)
    return F.silu(F.conv1d(padded[None], weight[:, None], bias, groups=DIM))[0]


@pytest.fixture
def parts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(DIM, WIDTH, generator=gen), torch.randn(DIM, generator=gen)
    tokens = torch.randn(DIM, 12, generator=gen)
    # vLLM stores (lines, state_len, dim) and hands the kernels a transposed view; the
    # speculative layout has width - 1 + 1 columns. Garbage elsewhere must never be read.
    store = torch.full((3, WIDTH, DIM), 7.0)
    return weight, bias, tokens, store


def step(
    state: torch.Tensor,
    x: torch.Tensor,
    accepted: list[int],
    weight: torch.Tensor,
    bias: torch.Tensor,
    lengths: list[int],
    lines: tuple[int, int] = (1, 2),
) -> torch.Tensor:
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return causal_conv1d_update_spec(
        x.transpose(0, 1).contiguous(),
        state,
        weight,
        bias,
        "silu",
        conv_state_indices=torch.tensor([lines], dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        query_start_loc=starts,
        null_block_id=0,
    ).transpose(0, 1)


def test_rolling_window_matches_a_full_convolution(parts: tuple[torch.Tensor, ...]) -> None:
    weight, bias, tokens, store = parts
    state = store.transpose(-1, -2)
    expected = full_conv(tokens, weight, bias)
    # A prefill of tokens 0..3 leaves its last width-1 inputs in columns 0..2.
    state[1, :, : WIDTH - 1] = tokens[:, 1:4]
    # The one-token last chunk of a prefill (the row vLLM's CPU kernel got wrong).
    out = step(state, tokens[:, 4:5], [1], weight, bias, [1])
    torch.testing.assert_close(out[:, 0], expected[:, 4])
    # A decode step: sampled token 5 plus a draft that will be rejected.
    draft = torch.randn(DIM, 1)
    out = step(state, torch.cat([tokens[:, 5:6], draft], -1), [1], weight, bias, [2])
    torch.testing.assert_close(out[:, 0], expected[:, 5])
    # Draft rejected (1 accepted); this time the draft is token 7 and is accepted.
    out = step(state, tokens[:, 6:8], [1], weight, bias, [2])
    torch.testing.assert_close(out, expected[:, 6:8])
    out = step(state, tokens[:, 8:10], [2], weight, bias, [2])
    torch.testing.assert_close(out, expected[:, 8:10])


def test_padding_rows_are_skipped(parts: tuple[torch.Tensor, ...]) -> None:
    weight, bias, tokens, store = parts
    state = store.transpose(-1, -2)
    before = store.clone()
    step(state, tokens[:, :1], [1], weight, bias, [1], lines=(0, 0))  # 0: the null block
    assert torch.equal(store, before)


def test_vllm_cpu_kernel_still_needs_the_fix(parts: tuple[torch.Tensor, ...]) -> None:
    """Canary: when vLLM's own CPU kernel gets this row right, drop the patch
    (service/engine/vllm_patches/cpu_mamba.py)."""
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

    weight, bias, tokens, store = parts
    state = store.transpose(-1, -2)
    state[1, :, : WIDTH - 1] = tokens[:, 1:4]
    out = causal_conv1d_update_cpu(
        tokens[:, 4:5].transpose(0, 1).contiguous(),
        state,
        weight,
        bias,
        "silu",
        conv_state_indices=torch.tensor([[1, 2]], dtype=torch.int32),
        num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        pad_slot_id=0,
    )
    assert not torch.allclose(out[0], full_conv(tokens, weight, bias)[:, 4], atol=1e-3)


def scheduled(
    prompt: list[int], computed: int, tokens: int, drafts: list[int] | None
) -> tuple[Any, Request, SchedulerOutput]:
    """A new request as ``Scheduler.schedule`` hands it over: ``tokens`` scheduled after
    ``computed`` of ``prompt``, with ``drafts``; vLLM's own ``_update_after_schedule``
    has advanced its counts."""
    request = Request("r", prompt, SamplingParams(max_tokens=4), None)
    request.num_computed_tokens = computed
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(request, ([1, 2],))]
    output.num_scheduled_tokens = {"r": tokens}
    output.total_num_scheduled_tokens = tokens + 2  # beside a decoding request's two
    output.scheduled_spec_decode_tokens = {} if drafts is None else {"r": drafts}
    scheduler: Any = SimpleNamespace(
        requests={"r": request}, defer_block_free=False, _inflight_prefills=set()
    )
    Scheduler._update_after_schedule(scheduler, output)
    return scheduler, request, output


def counts(request: Request, output: SchedulerOutput) -> tuple[Any, ...]:
    return (
        output.num_scheduled_tokens,
        output.total_num_scheduled_tokens,
        output.scheduled_spec_decode_tokens,
        request.num_computed_tokens,
        request.num_in_flight_tokens,
        request.is_prefill_chunk,
    )


def test_a_padded_one_token_prompt_becomes_the_step_vllm_schedules_unpadded() -> None:
    scheduler, padded, output = scheduled([5], computed=0, tokens=2, drafts=[-1])
    assert take_back_first_chunk_padding(scheduler, output) == ["r"]
    _, plain, unpadded = scheduled([5], computed=0, tokens=1, drafts=None)
    assert counts(padded, output) == counts(plain, unpadded)
    assert counts(padded, output)[:4] == ({"r": 1}, 3, {}, 1)


@pytest.mark.parametrize(
    ("prompt", "computed", "tokens", "drafts"),
    [
        ([5, 6, 7], 2, 2, [-1]),  # a last prompt token after state: vLLM decodes it
        (list(range(3, 43)), 0, 40, None),  # a prompt of 40: no drafts
        ([5], 0, 2, [9]),  # a real draft token is never taken back
    ],
    ids=["stateful-tail", "long-prompt", "real-draft"],
)
def test_every_other_row_is_left_as_vllm_scheduled_it(
    prompt: list[int], computed: int, tokens: int, drafts: list[int] | None
) -> None:
    scheduler, request, output = scheduled(prompt, computed, tokens, drafts)
    before = counts(request, output)
    assert take_back_first_chunk_padding(scheduler, output) == []
    assert counts(request, output) == before
