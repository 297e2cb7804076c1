"""The pinned pool's reuse and byte bound, on the CPU: ordinary tensors stand in for
pinned ones (the bound logic is the same; tests/engine/test_copy_out.py runs the real
pinned path where CUDA is present)."""

from __future__ import annotations

import random
import weakref
from types import SimpleNamespace

import pytest
import torch

from service.config import StorageSettings
from service.engine.connector.pinned import PinnedPool, size_class
from service.engine.connector.worker import HsxConnectorWorker
from service.engine.wire import ConnectorConfig

KIB = 1024


class Memory:
    """An allocator that knows which of its buffers are still alive, and their bytes."""

    def __init__(self) -> None:
        self.live = 0
        self.allocations = 0
        self.cache_emptied = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.live += nbytes
        self.allocations += 1
        weakref.finalize(buffer, self._freed, nbytes)
        return buffer

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def empty_cache(self) -> None:
        self.cache_emptied += 1

    def pool(self, max_bytes: int) -> PinnedPool:
        return PinnedPool(max_bytes, allocate=self.allocate, empty_cache=self.empty_cache)


def take(pool: PinnedPool, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.take((nbytes,), torch.uint8)


def test_sizes_round_up_to_a_power_of_two() -> None:
    assert [size_class(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]


def test_a_given_buffer_is_reused_with_a_view_of_the_asked_shape_and_dtype() -> None:
    memory = Memory()
    pool = memory.pool(64 * KIB)
    buffer, view = pool.take((7, 3, 8), torch.float32)
    assert (view.shape, view.dtype) == ((7, 3, 8), torch.float32)
    assert buffer.numel() == 1024  # 672 bytes, rounded up to a power of two
    assert view.data_ptr() == buffer.data_ptr()
    pool.give(buffer)
    again, view = pool.take((5, 3, 8), torch.bfloat16)
    assert again is buffer
    assert memory.allocations == 1
    assert (view.shape, view.dtype) == ((5, 3, 8), torch.bfloat16)
    assert pool.pinned_bytes == 1024


def test_the_smallest_idle_buffer_that_fits_is_taken() -> None:
    memory = Memory()
    pool = memory.pool(64 * KIB)
    buffers = {n: take(pool, n)[0] for n in (16 * KIB, 1 * KIB, 4 * KIB, 8 * KIB)}
    for buffer in buffers.values():
        pool.give(buffer)
    assert take(pool, 3 * KIB)[0] is buffers[4 * KIB]
    assert take(pool, 3 * KIB)[0] is buffers[8 * KIB]
    assert take(pool, 512)[0] is buffers[1 * KIB]
    assert memory.allocations == 4


def test_idle_buffers_are_dropped_largest_first_to_make_room() -> None:
    memory = Memory()
    pool = memory.pool(20 * KIB)
    small, large, held = (take(pool, n)[0] for n in (2 * KIB, 4 * KIB, 8 * KIB))
    small_at = small.data_ptr()
    pool.give(small)
    pool.give(large)
    del small, large
    assert memory.live == pool.pinned_bytes == 14 * KIB
    take(pool, 6 * KIB)  # needs 8 KiB more: dropping the idle 4 KiB one makes room
    assert memory.live == pool.pinned_bytes == 18 * KIB
    assert memory.cache_emptied == 1  # and PyTorch is asked to unpin it
    assert take(pool, 2 * KIB)[0].data_ptr() == small_at  # the 2 KiB one stayed
    assert memory.allocations == 4
    assert pool.unpinned_takes == 0
    assert held.numel() == 8 * KIB


def test_without_room_a_take_gets_a_pageable_buffer_that_is_never_pooled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = Memory()
    pool = memory.pool(8 * KIB)
    held, _ = take(pool, 8 * KIB)
    idle, _ = take(pool, 0)  # the bound is full: even a 1-byte buffer cannot be pooled
    assert pool.unpinned_takes == 1
    extra, view = take(pool, 3 * KIB)
    assert extra.numel() == view.numel() == 3 * KIB  # exact size: not a size class
    assert pool.pinned_bytes == memory.live == 8 * KIB
    assert memory.allocations == 1
    view.fill_(7)  # a usable buffer all the same
    pool.give(extra)
    pool.give(idle)
    pool.give(held)
    assert take(pool, 3 * KIB)[0] is held  # the pageable ones were not kept
    assert pool.unpinned_takes == 2
    assert memory.allocations == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # said once, counted after
    assert "at their bound (8192 bytes" in warnings[0]


def test_an_object_larger_than_the_bound_is_copied_into_pageable_memory() -> None:
    memory = Memory()
    pool = memory.pool(4 * KIB)
    buffer, view = take(pool, 5 * KIB)
    assert view.numel() == 5 * KIB
    assert pool.pinned_bytes == memory.allocations == 0
    pool.give(buffer)
    assert take(pool, 4 * KIB)[0].numel() == 4 * KIB  # the bound itself still pools
    assert pool.pinned_bytes == 4 * KIB


def test_random_takes_and_gives_never_exceed_the_bound_nor_share_a_buffer() -> None:
    memory = Memory()
    bound = 48 * KIB
    pool = memory.pool(bound)
    rng = random.Random(13)
    held: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for step in range(3000):
        if held and (len(held) >= 4 or rng.random() < 0.5):
            buffer, view, mark = held.pop(rng.randrange(len(held)))
            assert bool((view == mark).all()), "another take wrote into this buffer"
            pool.give(buffer)
            del buffer, view
        else:
            # Sizes drift, as prompt lengths do, so idle buffers stop fitting.
            nbytes = rng.randrange(1, [1, 4, 16, 32][step // 250 % 4] * KIB)
            buffer, view = take(pool, nbytes)
            assert view.numel() == nbytes
            view.fill_(step % 251)
            held.append((buffer, view, step % 251))
        assert memory.live == pool.pinned_bytes <= bound
    # The sequence reached the bound, dropped idle buffers, and reused the rest.
    assert pool.unpinned_takes > 0
    assert memory.cache_emptied > 0
    assert memory.allocations < 20


def test_an_allocation_failure_gives_its_bytes_back() -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("cannot pin")

    pool = PinnedPool(8 * KIB, allocate=refuse, empty_cache=lambda: None)
    with pytest.raises(RuntimeError, match="cannot pin"):
        take(pool, KIB)
    assert pool.pinned_bytes == 0


def test_the_worker_bounds_its_pool_by_the_in_flight_ceiling() -> None:
    config = ConnectorConfig(
        model_name="m",
        completion_address="ipc:///unused",
        storage=StorageSettings(url="/unused"),
        max_bytes_in_flight=3 * 1024**3,
    )
    half = HsxConnectorWorker(SimpleNamespace(), config, 16)  # type: ignore[arg-type]
    assert half._pinned.max_bytes == 3 * 1024**3
    assert half._pinned.pinned_bytes == 0  # nothing is pinned before a CUDA copy-out
