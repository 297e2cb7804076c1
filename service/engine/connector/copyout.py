"""Copying one request's states out of the hidden-state cache: a strategy per device.

:class:`CpuCopy` gathers synchronously on the forward pass's thread; :class:`CudaCopy`
gathers and runs the codec's device stage on a side stream into reused pinned buffers
(``pinned.py``), off the forward pass's critical path. Both copy only a token
selection's rows, and reduce a mean on the device before the copy (:func:`pool`).
Both make a
:class:`~service.engine.jobs.CopyOut`; the worker picks one by the cache's device, once.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from service import codecs
from service.engine.connector.pinned import PinnedPool
from service.engine.jobs import CopyOut, PendingSave


def slot_indices(
    block_ids: Any, block_size: int, num_tokens: int, positions: Any = None
) -> tuple[Any, Any]:
    """(block index, offset in block) of each of the first ``num_tokens`` slots, or of
    the slots of ``positions`` (token positions, a sequence) when given."""
    if positions is None:
        positions = torch.arange(num_tokens, dtype=torch.long)
    else:
        positions = torch.as_tensor(positions, dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks, positions % block_size


def gather(cache: torch.Tensor, blocks: Any, offsets: Any, index: Any) -> torch.Tensor:
    """The states [tokens, layers, hidden] of these slots of ``cache``, as a new tensor.

    Only the requested layers (``index``; None: all) are read. Each (token, layer) is
    ``hidden`` values in a row of the cache, so a contiguous cache is read with one
    ``index_select`` over its rows: a copy per row, several times faster than advanced
    indexing over three dimensions, and it runs on the forward pass's thread
    (docs/profile.md).
    """
    if not cache.is_contiguous():
        if index is None:
            return cache[blocks, :, offsets]
        return cache[blocks[:, None], index[None, :], offsets[:, None]]
    _, num_layers, block_size, hidden = cache.shape
    if index is None:
        index = torch.arange(num_layers, device=cache.device)
    rows = (blocks[:, None] * num_layers + index[None, :]) * block_size + offsets[:, None]
    picked = cache.view(-1, hidden).index_select(0, rows.reshape(-1))
    return picked.view(len(blocks), len(index), hidden)


def pool(states: torch.Tensor, save: PendingSave) -> torch.Tensor:
    """``states`` as the object stores them: their mean as one row [1, L, H] when
    ``save`` is pooled, else unchanged.

    The mean is summed in float32 (bfloat16 and float16 sums lose digits by the
    hundreds of tokens) and cast back to the model dtype, so every codec sees the
    model's dtype as it does for rows.
    """
    if not save.pooled:
        return states
    mean = states.sum(dim=0, keepdim=True, dtype=torch.float32) / states.shape[0]
    return mean.to(states.dtype)


class CopyStrategy(ABC):
    """How a save's states leave the cache ``[blocks, layers, block_size, hidden]``."""

    #: The copy is complete when ``start`` returns: the blocks can go back at once.
    synchronous: ClassVar[bool]

    def __init__(self, cache: torch.Tensor, block_size: int) -> None:
        self._cache = cache
        self._block_size = block_size

    def shape(self, save: PendingSave) -> tuple[int, int, int]:
        """[T, L, H] of ``save``'s states."""
        layers = self._cache.shape[1] if save.layer_index is None else len(save.layer_index)
        return save.rows, layers, self._cache.shape[3]

    @abstractmethod
    def host_nbytes(self, save: PendingSave) -> int:
        """Host memory ``save``'s copy takes: what the in-flight ceiling counts."""

    @abstractmethod
    def start(self, save: PendingSave) -> CopyOut:
        """Start copying ``save``'s states to host memory."""

    def _slots(self, save: PendingSave) -> tuple[Any, Any, Any]:
        # Only the selected positions' slots: the rest never leave the cache.
        blocks, offsets = slot_indices(
            save.block_ids, self._block_size, len(save.token_ids), save.positions
        )
        index = None if save.layer_index is None else torch.tensor(save.layer_index)
        return blocks, offsets, index


class CpuCopy(CopyStrategy):
    """A plain gather: the model-dtype states, copied before ``start`` returns.

    The codec runs later, in the writer (it counts the object at its encoded size once
    encoded), so the copy is counted at the model dtype's size.
    """

    synchronous = True

    def host_nbytes(self, save: PendingSave) -> int:
        return codecs.states_nbytes(self.shape(save), self._cache.dtype)

    def start(self, save: PendingSave) -> CopyOut:
        blocks, offsets, index = self._slots(save)
        # Advanced indexing copies synchronously: the result shares nothing with the
        # cache, so the blocks can go back at once and the time measured is the copy's.
        started = time.perf_counter()
        states = pool(gather(self._cache, blocks, offsets, index), save)
        copy_s = time.perf_counter() - started
        return CopyOut({"hidden_states": states}, wait=lambda: copy_s)


class CudaCopy(CopyStrategy):
    """Gather and the codec's device stage on a side stream, then a copy into reused
    pinned buffers; the copy and the buffers are the codec's size (fp8 and bf16 shrink
    on the device).

    The forward pass is not blocked: the writer thread waits on the copy's event (and
    reads the copy's own duration from the timing events: the launch returns at once),
    and the blocks go back only once the worker sees the event complete.
    """

    synchronous = False

    def __init__(self, cache: torch.Tensor, block_size: int, pinned: PinnedPool) -> None:
        super().__init__(cache, block_size)
        self._pinned = pinned
        self._stream: Any = None

    def host_nbytes(self, save: PendingSave) -> int:
        return codecs.prepared_nbytes(save.codec, self.shape(save), self._cache.dtype)

    def start(self, save: PendingSave) -> CopyOut:
        blocks, offsets, index = self._slots(save)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._cache.device)
        ready = torch.cuda.Event()
        ready.record()  # after the forward pass that wrote the states
        self._stream.wait_event(ready)
        buffers, hosts = [], {}
        started = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            # Recorded on the side stream after its wait: times the gather and the copy.
            started.record(self._stream)
            device = self._cache.device
            gathered = pool(
                gather(
                    self._cache,
                    blocks.to(device, non_blocking=True),
                    offsets.to(device, non_blocking=True),
                    None if index is None else index.to(device, non_blocking=True),
                ),
                save,
            )
            for name, tensor in codecs.prepare(save.codec, gathered).items():
                buffer, host = self._pinned.take(tuple(tensor.shape), tensor.dtype)
                host.copy_(tensor, non_blocking=True)
                buffers.append(buffer)
                hosts[name] = host
            done.record(self._stream)
        return CopyOut(
            hosts,
            prepared=True,
            wait=_cuda_wait(started, done),
            done=done.query,
            release=_give_back(self._pinned, buffers),
        )


def _cuda_wait(started: Any, done: Any) -> Callable[[], float]:
    def wait() -> float:
        done.synchronize()
        return float(started.elapsed_time(done)) / 1000.0  # milliseconds

    return wait


def _give_back(pinned: PinnedPool, buffers: list[torch.Tensor]) -> Callable[[], None]:
    def release() -> None:
        for buffer in buffers:
            pinned.give(buffer)

    return release
