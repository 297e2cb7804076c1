"""The worker half's copy-out, without an engine: slots gathered right, timed honestly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.config import StorageSettings
from service.engine.connector.common import PendingSave
from service.engine.connector.worker import HsxConnectorWorker, slot_indices
from service.engine.wire import ConnectorConfig

BLOCK = 4


def worker(cache: torch.Tensor) -> HsxConnectorWorker:
    config = ConnectorConfig(
        model_name="m",
        completion_address="ipc:///unused",
        storage=StorageSettings(url="/unused"),
        max_bytes_in_flight=1,
    )
    half = HsxConnectorWorker(SimpleNamespace(), config, BLOCK)  # type: ignore[arg-type]
    half._cache = cache  # what register_kv_caches finds in a real engine
    return half


def cache(device: str) -> torch.Tensor:
    # [blocks, layers, block_size, hidden], the LBNHC layout the connector asks for.
    return torch.randn(6, 3, BLOCK, 8, device=device)


def expected(states: torch.Tensor, block_ids: list[int], tokens: int) -> torch.Tensor:
    rows = [states[block_ids[t // BLOCK], :, t % BLOCK] for t in range(tokens)]
    return torch.stack(rows).cpu()


def save(block_ids: list[int], tokens: int) -> PendingSave:
    return PendingSave("r1", "hsx/t/k", list(range(tokens)), block_ids, {})


def test_slot_indices_follow_the_block_table() -> None:
    blocks, offsets = slot_indices([5, 2, 9], BLOCK, 10)
    assert blocks.tolist() == [5] * 4 + [2] * 4 + [9] * 2
    assert offsets.tolist() == [0, 1, 2, 3] * 2 + [0, 1]


def test_cpu_copy_out_is_a_private_copy_of_the_slots() -> None:
    states = cache("cpu")
    half = worker(states)
    job = half._copy_out(save([4, 1], 7), nbytes=0)
    assert torch.equal(job.hidden_states, expected(states, [4, 1], 7))
    assert job.wait_copied() >= 0
    assert half._copied == {"r1"}  # blocks can go back at once
    states.zero_()
    assert job.hidden_states.abs().sum() > 0  # shares nothing with the cache


@pytest.mark.parametrize("layer_index", [None, [2, 0], [1]])
@pytest.mark.parametrize("contiguous", [True, False])
def test_cpu_copy_out_reads_the_requested_layers_of_any_cache_layout(
    layer_index: list[int] | None, contiguous: bool
) -> None:
    states = cache("cpu")
    if not contiguous:  # the same values in a cache vLLM laid out another way
        states = states.transpose(1, 2).contiguous().transpose(1, 2)
    half = worker(states)
    pending = save([5, 0, 3], 11)
    pending.layer_index = layer_index
    job = half._copy_out(pending, nbytes=0)
    want = expected(states, [5, 0, 3], 11)
    if layer_index is not None:
        want = want[:, layer_index]
    assert torch.equal(job.hidden_states, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_out_is_exact_and_times_the_copy() -> None:
    states = cache("cuda")
    half = worker(states)
    job = half._copy_out(save([4, 1], 7), nbytes=0)
    assert "r1" not in half._copied  # not before its event completed
    copy_s = job.wait_copied()  # waits for the copy; its duration from the events
    assert 0 < copy_s < 60
    assert torch.equal(job.hidden_states.view(7, 3, 8), expected(states, [4, 1], 7))
    assert job.hidden_states.is_pinned()
    half._poll_copies()
    assert half._copied == {"r1"}
    job.release()
    again: Any = half._pinned.take((7, 3, 8), torch.float32)
    assert again[0].is_pinned()  # the buffer went back to the pool and is reused
