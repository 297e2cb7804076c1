"""The connector's worker half: copy each saved request's states out, hand them to the writer.

Only tensor-parallel rank 0 copies and writes; the other ranks only install the CPU
Mamba fix. A request's copy starts when the step after the one that finished it binds
its metadata, before that step's forward pass, so the object is written while the
forward pass runs; on CUDA the copy is off its critical path (a side stream into reused
pinned buffers, no more bytes of them than the in-flight ceiling: ``pinned.py``). A
request's blocks go back to vLLM once its copy is complete. Only the request's layers
are gathered, and on CUDA the codec's device stage (fp8 quantisation, bf16 cast) runs
before the copy, so the copy and the pinned buffers shrink with it. How each device
copies is ``copyout.py``'s.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

import torch

from service.engine.completion import CompletionSender
from service.engine.connector.common import FailedSave, HsxConnectorMetadata, PendingSave
from service.engine.connector.copyout import CopyStrategy, CpuCopy, CudaCopy, slot_indices
from service.engine.connector.pinned import PinnedPool
from service.engine.jobs import CopyOut, WriteJob
from service.engine.wire import ConnectorConfig, WriteFailure
from service.engine.writer import WriterPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["HsxConnectorWorker", "slot_indices"]

log = logging.getLogger(__name__)


class HsxConnectorWorker:
    """Copies saved requests' hidden states out of the cache into the writer pool."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig, block_size: int) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._block_size = block_size
        self._cache: torch.Tensor | None = None
        self._copier: CopyStrategy | None = None
        self._writer: WriterPool | None = None
        self._queue: deque[PendingSave | FailedSave] = deque()
        self._copied: set[str] = set()
        self._copying: dict[str, CopyOut] = {}  # req_id -> its copy-out, still running
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
            from service.engine.allocator import steady_heap
            from service.engine.vllm_patches import cpu_mamba

            cpu_mamba.install()  # every rank: each runs its own Mamba layers
            steady_heap()  # every rank: each runs its own forward pass on the heap
        if get_tensor_model_parallel_rank() != 0:
            return
        config = self._config
        sender = CompletionSender(config.completion_address, config.completion_secret)
        sender.hello()  # start-up waits for it: proof that completions reach the API
        self._writer = WriterPool(
            config.storage,
            sender,
            max_bytes_in_flight=config.max_bytes_in_flight,
            # storage.io_threads also bounds the storage's own I/O threads: one setting
            # for both, since each write holds one of them.
            max_concurrent_writes=config.storage.io_threads,
            storage_factory=config.storage_factory,
        )

    @property
    def _copy(self) -> CopyStrategy:
        """The copy strategy of the cache's device, chosen once."""
        if self._copier is None:
            cache = self._cache
            assert cache is not None
            if cache.is_cuda:
                self._copier = CudaCopy(cache, self._block_size, self._pinned)
            else:
                self._copier = CpuCopy(cache, self._block_size)
        return self._copier

    def start(self, meta: HsxConnectorMetadata) -> None:
        """Start the saves the scheduler handed over with this step, before its forward
        pass: the requests finished in the step before, so their states are complete.

        Started here, not after the step's forward pass, each object is written while
        that pass runs: a request's answer comes one forward pass sooner, and a client
        that keeps N requests in flight refills the next step (on the 2-core host, 256
        prompts of 64 tokens, 64 in flight: 8 full steps instead of 10 to 11 partial
        ones; docs/profile.md, ninth stop). On CUDA the copy's stream waits for the
        previous step's work, as before, and overlaps this one's.
        """
        if self._writer is None:
            return  # not rank 0
        self._queue.extend(meta.saves)
        self._start_queued()

    def get_finished(self) -> set[str] | None:
        """Start saves that waited for room; return the requests whose copies completed."""
        if self._writer is None:
            return None  # not rank 0
        self._start_queued()
        self._poll_copies()
        done, self._copied = self._copied, set()
        return done or None

    def _start_queued(self) -> None:
        assert self._writer is not None
        while self._queue:
            save = self._queue[0]
            if isinstance(save, FailedSave):
                self._queue.popleft()
                self._fail(save.req_id, save.key, 0, save.failure)
                continue
            nbytes = self._copy.host_nbytes(save)
            if not self._writer.budget.reserve(nbytes):
                return  # over the ceiling: blocks stay held until writes drain
            self._queue.popleft()
            try:
                job = self._copy_out(save, nbytes)
            except Exception as exc:
                log.exception("copy-out failed for %s", save.key)
                message = f"copy-out failed: {type(exc).__name__}: {exc}"
                failure = WriteFailure(type="internal_error", message=message)
                self._fail(save.req_id, save.key, nbytes, failure)
                continue
            self._writer.submit(job)

    def _fail(self, req_id: str, key: str, nbytes: int, failure: WriteFailure) -> None:
        assert self._writer is not None
        self._writer.report_failure(key, failure, nbytes)
        self._copied.add(req_id)

    def _poll_copies(self) -> None:
        """Requests whose device-to-host copy has completed can give their blocks back."""
        for req_id, copy in list(self._copying.items()):
            if copy.done():
                del self._copying[req_id]
                self._copied.add(req_id)

    def _copy_out(self, save: PendingSave, nbytes: int) -> WriteJob:
        """Start ``save``'s copy-out (``nbytes`` reserved for it): the job to write."""
        copy = self._copy.start(save)
        if self._copy.synchronous:
            self._copied.add(save.req_id)  # shares nothing with the cache
        else:
            self._copying[save.req_id] = copy
        return WriteJob(save, copy, nbytes)

    def shutdown(self) -> None:
        """Drain the writer: every copied-out object is written or reported."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
