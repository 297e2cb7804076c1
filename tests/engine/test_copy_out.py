"""The worker half's copy-out, without an engine: slots gathered right, timed honestly.

On CUDA: the side-stream gather into pooled pinned buffers gives the bytes a plain copy
gives, for every codec, and the pool stays within its bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load

from service import codecs
from service.codecs import Codec
from service.config import StorageSettings
from service.engine.completion import CompletionReceiver, CompletionSender
from service.engine.connector.common import FailedSave, HsxConnectorMetadata
from service.engine.connector.worker import HsxConnectorWorker, slot_indices
from service.engine.jobs import PendingSave, WriteJob
from service.engine.objects import object_metadata
from service.engine.wire import ConnectorConfig, WriteFailure
from service.engine.writer import WriterPool
from service.storage.keys import new_object_key

BLOCK = 4
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the CPU path copies synchronously)"
)


def worker(cache: torch.Tensor, ceiling: int = 1024**2) -> HsxConnectorWorker:
    config = ConnectorConfig(
        model_name="m",
        completion_address="ipc:///unused",
        storage=StorageSettings(url="/unused"),
        max_bytes_in_flight=ceiling,
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


def save(
    block_ids: list[int],
    tokens: int,
    codec: Codec = "raw",
    layer_index: list[int] | None = None,
    req_id: str = "r1",
) -> PendingSave:
    return PendingSave(
        req_id,
        "hsx/t/k",
        tuple(range(tokens)),
        tuple(block_ids),
        {},
        codec=codec,
        layer_index=None if layer_index is None else tuple(layer_index),
    )


def test_slot_indices_follow_the_block_table() -> None:
    blocks, offsets = slot_indices([5, 2, 9], BLOCK, 10)
    assert blocks.tolist() == [5] * 4 + [2] * 4 + [9] * 2
    assert offsets.tolist() == [0, 1, 2, 3] * 2 + [0, 1]


def test_cpu_copy_out_is_a_private_copy_of_the_slots() -> None:
    states = cache("cpu")
    half = worker(states)
    job = half._copy_out(save([4, 1], 7), nbytes=0)
    assert torch.equal(job.copy.states, expected(states, [4, 1], 7))
    assert job.copy.wait() >= 0
    assert half._copied == {"r1"}  # blocks can go back at once
    states.zero_()
    assert job.copy.states.abs().sum() > 0  # shares nothing with the cache


@pytest.mark.parametrize("layer_index", [None, [2, 0], [1]])
@pytest.mark.parametrize("contiguous", [True, False])
def test_cpu_copy_out_reads_the_requested_layers_of_any_cache_layout(
    layer_index: list[int] | None, contiguous: bool
) -> None:
    states = cache("cpu")
    if not contiguous:  # the same values in a cache vLLM laid out another way
        states = states.transpose(1, 2).contiguous().transpose(1, 2)
    half = worker(states)
    pending = save([5, 0, 3], 11, layer_index=layer_index)
    job = half._copy_out(pending, nbytes=0)
    want = expected(states, [5, 0, 3], 11)
    if layer_index is not None:
        want = want[:, layer_index]
    assert torch.equal(job.copy.states, want)


async def test_a_step_starts_its_saves_in_order_within_the_ceiling(tmp_path: Path) -> None:
    # The worker half on the CPU, with a real writer pool: a save is copied out and
    # written as soon as its step starts, a failed one reported in its turn, and a save
    # over the ceiling waits (its blocks held) until the write before it has released
    # its bytes.
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    receiver.start()
    states = cache("cpu")
    half = worker(states)
    one_object = 7 * 3 * 8 * 4  # 7 tokens x 3 layers x 8 float32 values
    half._writer = WriterPool(
        StorageSettings(url=str(tmp_path / "objects")),
        CompletionSender(receiver.address, receiver.secret),
        max_bytes_in_flight=one_object,
        max_concurrent_writes=2,
    )
    metadata = object_metadata("m", (0, 1, 2), "float32")

    def planned(req_id: str, block_ids: list[int]) -> PendingSave:
        key = new_object_key("hsx", "t")
        return dataclasses.replace(save(block_ids, 7, req_id=req_id), key=key, metadata=metadata)

    first, second = planned("r1", [4, 1]), planned("r3", [2, 5])
    failed = FailedSave(
        "r2", new_object_key("hsx", "t"), WriteFailure(type="invalid_request", message="no")
    )
    waiters = [receiver.expect(k) for k in (first.key, failed.key, second.key)]
    try:
        half.start(HsxConnectorMetadata(saves=[first, failed, second]))
        # Written from the step's start, before its forward pass and get_finished.
        written, reported = await asyncio.wait_for(asyncio.gather(*waiters[:2]), 30)
        assert reported.failure == failed.failure
        assert not waiters[2].done()  # over the ceiling: waits, its blocks held
        # The first write released its bytes: the step's end starts the one that waited.
        assert half.get_finished() == {"r1", "r2", "r3"}
        later = await asyncio.wait_for(waiters[2], 30)
        for pending, done in ((first, written), (second, later)):
            assert done.stored is not None
            assert done.stored.shape == (7, 3, 8)
            stored = load((tmp_path / "objects" / pending.key).read_bytes())
            want = expected(states, list(pending.block_ids), 7)
            assert torch.equal(stored["hidden_states"], want)
        assert later.bytes_in_flight == 0
    finally:
        await asyncio.to_thread(half.shutdown)
        await receiver.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_copy_out_is_exact_and_times_the_copy() -> None:
    states = cache("cuda")
    half = worker(states)
    job = half._copy_out(save([4, 1], 7), nbytes=0)
    assert "r1" not in half._copied  # not before its event completed
    copy_s = job.copy.wait()  # waits for the copy; its duration from the events
    assert 0 < copy_s < 60
    assert torch.equal(job.copy.states.view(7, 3, 8), expected(states, [4, 1], 7))
    assert job.copy.states.is_pinned()
    half._poll_copies()
    assert half._copied == {"r1"}
    job.copy.release()
    again: Any = half._pinned.take((7, 3, 8), torch.float32)
    assert again[0].is_pinned()  # the buffer went back to the pool and is reused


def plain_copies(
    states: torch.Tensor, block_ids: list[int], tokens: int, codec: Codec, index: Any
) -> dict[str, torch.Tensor]:
    """The codec's device stage on a plain gather, then a plain ``.cpu()`` of each tensor;
    each checked against a plain pinned copy of the same device bytes first."""
    blocks, offsets = slot_indices(block_ids, BLOCK, tokens)
    gathered = states[blocks.cuda(), :, offsets.cuda()]
    if index is not None:
        gathered = gathered[:, index]
    copies = {}
    for name, tensor in codecs.prepare(codec, gathered).items():
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        copies[name] = tensor.cpu()
        assert same_bytes(pinned, copies[name])
    return copies


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (fp8 has no ``torch.equal``; NaN payloads count too)."""
    if (a.shape, a.dtype) != (b.shape, b.dtype):
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check(job: WriteJob, expected: dict[str, torch.Tensor]) -> None:
    job.copy.wait()
    assert job.copy.prepared
    assert set(job.copy.tensors) == set(expected)
    for name, tensor in expected.items():
        assert same_bytes(job.copy.tensors[name], tensor), name
    assert job.copy.states is job.copy.tensors["hidden_states"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layer_index", [None, [0, 2]])
@pytest.mark.parametrize("codec", codecs.CODECS)
def test_cuda_copy_out_gives_the_bytes_of_a_plain_copy(
    codec: Codec, layer_index: list[int] | None
) -> None:
    states = cache("cuda")
    half = worker(states)
    job = half._copy_out(save([4, 1, 5], 10, codec, layer_index), nbytes=0)
    index = None if layer_index is None else torch.tensor(layer_index, device="cuda")
    check(job, plain_copies(states, [4, 1, 5], 10, codec, index))
    assert job.copy.prepared
    assert all(t.is_pinned() for t in job.copy.tensors.values())
    job.copy.release()


@pytest.mark.gpu
@needs_cuda
def test_cuda_copy_outs_stay_within_the_pool_bound() -> None:
    states = torch.randn(64, 3, BLOCK, 8, device="cuda")
    ceiling = 4096  # a few objects' worth: idle buffers must make room, or take turns
    half = worker(states, ceiling)
    rng = random.Random(0)
    pending: list[tuple[WriteJob, dict[str, torch.Tensor]]] = []
    for i in range(80):
        # Mostly small objects, some larger than the whole bound (200 tokens: 19 KB raw).
        tokens = 200 if i % 20 == 7 else rng.randrange(1, 41)
        block_ids = rng.sample(range(64), -(-tokens // BLOCK))
        codec: Codec = rng.choice(list(codecs.CODECS))
        job = half._copy_out(save(block_ids, tokens, codec, req_id=f"r{i}"), nbytes=0)
        pending.append((job, plain_copies(states, block_ids, tokens, codec, None)))
        assert half._pinned.pinned_bytes <= ceiling
        if len(pending) > 3:  # the writer gives buffers back as it encodes
            job, expected = pending.pop(0)
            check(job, expected)
            job.copy.release()
    for job, expected in pending:
        check(job, expected)
        job.copy.release()
    assert 0 < half._pinned.pinned_bytes <= ceiling
    assert half._pinned.unpinned_takes >= 4  # the large ones, copied exactly all the same
