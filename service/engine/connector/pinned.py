"""Page-locked host buffers for the CUDA copy-out: reused, and bounded in bytes.

Pinning memory is slow (the driver maps and locks every page), so the copy-out reuses
buffers across requests. Left alone such a pool keeps the largest set of buffers it
ever needed, so it is bounded: it never holds more than ``max_bytes`` (the connector
passes the writer's in-flight ceiling), counting the buffers handed out and the idle
ones alike.

- Sizes are rounded up to a power of two, as PyTorch's pinned allocator rounds them
  anyway: the count is what is pinned, and buffers of one size class are reused.
- A take that finds no idle buffer large enough drops idle buffers, largest first,
  until the new one fits within the bound, and asks PyTorch to return their pages
  (its allocator otherwise keeps freed pinned blocks cached, still locked).
- When the buffers handed out leave no room (one object larger than the ceiling, which
  the writer lets through alone, or the rounding of several), the take gets an
  ordinary pageable buffer of the exact size, never pooled. The copy into it is still
  correct; CUDA stages it, so the launching thread waits for it. ``unpinned_takes``
  counts these; a steady rise means the ceiling is too tight for the objects.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

Allocate = Callable[[int], torch.Tensor]


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (uint8)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def empty_host_cache() -> None:
    """Hand PyTorch's cached, unused pinned blocks back to the driver (CUDA only)."""
    empty = getattr(torch._C, "_host_emptyCache", None)  # absent from CPU builds
    if empty is not None and torch.cuda.is_initialized():
        empty()


def size_class(nbytes: int) -> int:
    """The power of two at least ``nbytes`` (at least 1): the bytes a buffer pins."""
    return 1 << max(0, nbytes - 1).bit_length()


class PinnedPool:
    """Host buffers for device-to-host copies, at most ``max_bytes`` of them pinned.

    Taken by the worker thread, given back by the writer's threads once the object is
    encoded. ``allocate`` makes a pooled buffer of the bytes asked (pinned by default;
    tests pass ordinary tensors), ``empty_cache`` runs after idle buffers are dropped.
    """

    def __init__(
        self,
        max_bytes: int,
        allocate: Allocate = pinned_buffer,
        empty_cache: Callable[[], None] = empty_host_cache,
    ) -> None:
        self.max_bytes = max_bytes
        self._allocate = allocate
        self._empty_cache = empty_cache
        self._free: list[torch.Tensor] = []  # oldest first
        self._taken: dict[int, torch.Tensor] = {}  # id -> pooled buffer handed out
        self._bytes = 0  # free and taken pooled buffers
        self._unpinned = 0
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the pool's buffers, idle and handed out: never above ``max_bytes``."""
        return self._bytes

    @property
    def unpinned_takes(self) -> int:
        """Takes answered with a pageable buffer because the bound left no room."""
        return self._unpinned

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer of at least the bytes ``shape`` needs, and a ``dtype`` view of it.

        Give the buffer (the first of the pair) back with :meth:`give` once the view's
        data has been used.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._take_bytes(nbytes)
        return buffer, buffer[:nbytes].view(dtype).view(shape)

    def give(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` for reuse (a pageable one is simply dropped)."""
        with self._lock:
            if self._taken.pop(id(buffer), None) is not None:
                self._free.append(buffer)

    def _take_bytes(self, nbytes: int) -> torch.Tensor:
        size = size_class(nbytes)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # the smallest that fits; the oldest of equals
                # By index: list.remove would compare tensors with ==, element-wise.
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._taken[id(buffer)] = buffer
                return buffer
            dropped = self._make_room(size)
            pooled = self._bytes + size <= self.max_bytes
            if pooled:
                self._bytes += size  # counted before the slow allocation, outside the lock
            else:
                self._unpinned += 1
        if dropped:
            dropped.clear()  # the last references: PyTorch can free them now
            self._empty_cache()
        if not pooled:
            if self._unpinned == 1:  # once: the counter tells the rest
                log.warning(
                    "pinned buffers at their bound (%d bytes, the in-flight ceiling): a "
                    "%d-byte copy goes through pageable memory and waits for the GPU",
                    self.max_bytes,
                    nbytes,
                )
            return torch.empty(nbytes, dtype=torch.uint8)
        try:
            buffer = self._allocate(size)
        except BaseException:
            with self._lock:
                self._bytes -= size
            raise
        with self._lock:
            self._taken[id(buffer)] = buffer
        return buffer

    def _make_room(self, size: int) -> list[torch.Tensor]:
        """Drop idle buffers, largest first, until ``size`` more fits; none if it cannot."""
        idle = sum(b.numel() for b in self._free)
        if self._bytes - idle + size > self.max_bytes:
            return []  # the taken ones alone leave no room: keep the idle ones for later
        dropped = []
        while self._bytes + size > self.max_bytes:
            # The largest, the oldest of equals: fewest buffers dropped.
            largest = max(range(len(self._free)), key=lambda i: (self._free[i].numel(), -i))
            buffer = self._free.pop(largest)
            self._bytes -= buffer.numel()
            dropped.append(buffer)
        return dropped
