"""The connector's worker half: copy each saved request's states out, hand them to the writer.

Only tensor-parallel rank 0 copies and writes; the other ranks only install the CPU
Mamba fix. Copies run after the forward pass that finished the request, off its
critical path on CUDA (a side stream into reused pinned buffers, no more bytes of them
than the in-flight ceiling: ``pinned.py``); a request's blocks go back to vLLM once its
copy is complete. Only the request's layers are gathered, and on CUDA the codec's
device stage (fp8 quantisation, bf16 cast) runs before the copy, so the copy and the
pinned buffers shrink with it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from service import codecs
from service.engine.completion import CompletionSender
from service.engine.connector.common import HsxConnectorMetadata, PendingSave
from service.engine.connector.pinned import PinnedPool
from service.engine.wire import ConnectorConfig, WriteFailure
from service.engine.writer import WriteJob, WriterPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


def slot_indices(block_ids: list[int], block_size: int, num_tokens: int) -> tuple[Any, Any]:
    """(block index, offset in block) of each of the first ``num_tokens`` slots."""
    positions = torch.arange(num_tokens, dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks, positions % block_size


def loss_mask(spans: list[tuple[int, int]], num_tokens: int) -> torch.Tensor:
    """uint8 [num_tokens]: 1 on the supervised ``[start, end)`` ranges."""
    mask = torch.zeros(num_tokens, dtype=torch.uint8)
    for start, end in spans:
        mask[start:end] = 1
    return mask


class HsxConnectorWorker:
    """Copies saved requests' hidden states out of the cache into the writer pool."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig, block_size: int) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._block_size = block_size
        self._cache: torch.Tensor | None = None
        self._writer: WriterPool | None = None
        self._queue: deque[PendingSave] = deque()
        self._copied: set[str] = set()
        self._copying: dict[str, Any] = {}  # req_id -> CUDA event of its copy-out
        self._copy_stream: Any = None
        # The in-flight ceiling already bounds the bytes copied out; the pool's own bound
        # keeps idle buffers and size rounding from pinning more than that.
        self._pinned = PinnedPool(config.max_bytes_in_flight)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the hidden-state cache layer; rank 0 starts the writer pool."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(
            self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)
        )
        if len(layers) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {len(layers)}")
        self._cache = kv_caches[next(iter(layers))]
        if self._cache.shape[2] != self._block_size:
            raise ValueError(
                f"hidden-state block size {self._block_size} does not match the cache "
                f"tensor's {self._cache.shape[2]}; slots would be read from the wrong place"
            )
        if self._cache.device.type == "cpu":
            from service.engine import cpu_mamba

            cpu_mamba.install()  # every rank: each runs its own Mamba layers
        if get_tensor_model_parallel_rank() != 0:
            return
        from service.engine.allocator import fix_mmap_threshold

        fix_mmap_threshold()  # freed objects leave RSS at once: see allocator.py
        config = self._config
        self._writer = WriterPool(
            config.storage,
            CompletionSender(config.completion_address),
            max_bytes_in_flight=config.max_bytes_in_flight,
            max_concurrent_writes=config.storage.io_threads,
            storage_factory=config.storage_factory,
        )

    def get_finished(self, meta: HsxConnectorMetadata | None) -> set[str] | None:
        """Start this step's saves; return the requests whose copies completed."""
        if self._writer is None:
            return None  # not rank 0
        if meta is not None:
            self._queue.extend(meta.saves)
        self._start_queued()
        self._poll_copies()
        done, self._copied = self._copied, set()
        return done or None

    def _start_queued(self) -> None:
        assert self._writer is not None
        while self._queue:
            save = self._queue[0]
            if save.failure is not None:
                self._queue.popleft()
                self._fail(save, 0, WriteFailure(type=save.failure_type, message=save.failure))
                continue
            nbytes = self._host_bytes(save)
            if not self._writer.try_reserve(nbytes):
                return  # over the ceiling: blocks stay held until writes drain
            self._queue.popleft()
            try:
                job = self._copy_out(save, nbytes)
            except Exception as exc:
                log.exception("copy-out failed for %s", save.key)
                message = f"copy-out failed: {type(exc).__name__}: {exc}"
                self._fail(save, nbytes, WriteFailure(type="internal_error", message=message))
                continue
            self._writer.submit(job)

    def _host_bytes(self, save: PendingSave) -> int:
        """Host memory ``save``'s copy-out takes: what the in-flight ceiling counts.

        On CUDA the codec's device stage runs before the copy, so fp8 and bf16 copies
        are encoded-size; on the CPU the copy is the model-dtype states, and the writer
        counts the object at its encoded size once encoded.
        """
        assert self._cache is not None
        layers = self._cache.shape[1] if save.layer_index is None else len(save.layer_index)
        shape = (len(save.token_ids), layers, self._cache.shape[3])
        codec = save.codec if self._cache.is_cuda else "raw"
        return codecs.prepared_nbytes(codec, shape, self._cache.dtype)

    def _gather(self, blocks: Any, offsets: Any, index: Any) -> torch.Tensor:
        """The states [tokens, layers, hidden] of these slots, as a new tensor.

        Only the requested layers are read. Each (token, layer) is ``hidden`` values in
        a row of the cache, so a contiguous cache is read with one ``index_select``
        over its rows: a copy per row, several times faster than advanced indexing over
        three dimensions, and it runs on the forward pass's thread (docs/profile.md).
        """
        cache = self._cache
        assert cache is not None
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

    def _fail(self, save: PendingSave, nbytes: int, failure: WriteFailure) -> None:
        assert self._writer is not None
        self._writer.report_failure(save.key, failure, nbytes)
        self._copied.add(save.req_id)

    def _poll_copies(self) -> None:
        """Requests whose device-to-host copy has completed can give their blocks back."""
        for req_id, event in list(self._copying.items()):
            if event.query():
                del self._copying[req_id]
                self._copied.add(req_id)

    def _copy_out(self, save: PendingSave, nbytes: int) -> WriteJob:
        assert self._cache is not None
        blocks, offsets = slot_indices(save.block_ids, self._block_size, len(save.token_ids))
        index = None if save.layer_index is None else torch.tensor(save.layer_index)
        token_ids = torch.tensor(save.token_ids, dtype=torch.int64)
        job = WriteJob(save.key, None, token_ids, save.metadata, nbytes)
        job.codec = save.codec
        if save.loss_spans is not None:
            job.loss_mask = loss_mask(save.loss_spans, len(save.token_ids))
        if self._cache.is_cuda:
            self._copying[save.req_id] = self._copy_out_cuda(job, blocks, offsets, index)
            return job
        # Advanced indexing copies synchronously: the result shares nothing with the
        # cache, so the blocks can go back at once and the time measured is the copy's.
        start = time.perf_counter()
        job.hidden_states = self._gather(blocks, offsets, index)
        copy_s = time.perf_counter() - start
        job.wait_copied = lambda: copy_s
        self._copied.add(save.req_id)
        return job

    def _copy_out_cuda(self, job: WriteJob, blocks: Any, offsets: Any, index: Any) -> Any:
        """Gather and run the codec's device stage on a side stream, then copy into
        reused pinned buffers; returns the copy's event.

        The forward pass is not blocked: the writer thread waits on the event (and reads
        the copy's own duration from the timing events: the launch returns at once), and
        the blocks go back only once ``_poll_copies`` sees it complete.
        """
        assert self._cache is not None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self._cache.device)
        ready = torch.cuda.Event()
        ready.record()  # after the forward pass that wrote the states
        self._copy_stream.wait_event(ready)
        buffers, hosts = [], {}
        started = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._copy_stream):
            # Recorded on the side stream after its wait: times the gather and the copy.
            started.record(self._copy_stream)
            device = self._cache.device
            gathered = self._gather(
                blocks.to(device, non_blocking=True),
                offsets.to(device, non_blocking=True),
                None if index is None else index.to(device, non_blocking=True),
            )
            for name, tensor in codecs.prepare(job.codec, gathered).items():
                buffer, host = self._pinned.take(tuple(tensor.shape), tensor.dtype)
                host.copy_(tensor, non_blocking=True)
                buffers.append(buffer)
                hosts[name] = host
            done.record(self._copy_stream)
        job.hidden_states, job.prepared = hosts["hidden_states"], hosts
        job.wait_copied = _cuda_wait(started, done)

        def release() -> None:
            for buffer in buffers:
                self._pinned.give(buffer)

        job.release = release
        return done

    def shutdown(self) -> None:
        """Drain the writer: every copied-out object is written or reported."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _cuda_wait(started: Any, done: Any) -> Callable[[], float]:
    def wait() -> float:
        done.synchronize()
        return float(started.elapsed_time(done)) / 1000.0  # milliseconds

    return wait
