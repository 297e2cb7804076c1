"""hsx's KV connector: copies each request's hidden states out of vLLM's KV cache.

Used with the ``extract_hidden_states`` speculative method, which caches the chosen
layers' hidden states in a cache group of their own (``HiddenStateCacheSpec``). Life of
one request:

Scheduler side (EngineCore process)
  1. ``request_finished_all_groups``: the request finished. If it is ours (it carries
     ``extra_args["hsx"]`` set by our engine wrapper) and was not aborted, hold its
     blocks (return True) and queue a save: key, token ids, hidden-state block ids.
  2. ``build_connector_meta``: hand queued saves to the workers with the next step.
  3. ``update_connector_output``: the workers reported a request copied out; its
     blocks are freed by vLLM, we forget it.

Worker side
  4. ``get_finished``: for each new save, reserve room under the in-flight ceiling,
     gather the request's slots (and only its requested layers) from the hidden-state
     cache, copy them to host memory (CUDA: the codec's device stage, e.g. fp8
     quantisation, on a side stream, then into reused pinned buffers; CPU: a plain
     copy) and hand the object to the writer pool. Requests over the ceiling wait,
     blocks still held. Report copied requests as finished sending so vLLM frees their
     blocks.
  5. The writer pool encodes (``service.codecs``), writes through ``service.storage``
     and pushes a completion (key, size, checksum, or the error) to the API process.

Only tensor-parallel rank 0 copies and writes; ``get_finished_count`` is 1 so vLLM
waits for rank 0 alone. What vLLM's example connector got right is kept (group found
by spec type, its own block size, save at finish so chunked prefill works); what it
lacked is added (no CUDA calls on CPU, storage behind our interface, failures reported
to the caller, keys made by the server, bounded memory, a drained shutdown).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from service import codecs
from service.config import StorageSettings
from service.engine.completion import CompletionSender
from service.engine.objects import object_metadata
from service.engine.writer import WriteJob, WriterPool
from service.storage import storage_factory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Key of our per-request parameters in ``SamplingParams.extra_args``.
REQUEST_ARG = "hsx"


@dataclass
class PendingSave:
    """One finished request whose hidden states must be copied out and written."""

    req_id: str
    key: str
    token_ids: list[int]
    block_ids: list[int]
    metadata: dict[str, str]
    codec: codecs.Codec = "raw"
    layers: list[int] | None = None  # a subset of the served layer ids; None: all


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    """Scheduler-to-worker message of one step: the saves to start."""

    saves: list[PendingSave] = field(default_factory=list)


def find_hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV-cache group that holds the extracted hidden states."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    if kv_cache_config is None:
        return 0
    groups = kv_cache_config.kv_cache_groups
    found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(
        f"expected one hidden-state KV-cache group among {len(groups)}, found {len(found)}"
    )


def slot_indices(block_ids: list[int], block_size: int, num_tokens: int) -> tuple[Any, Any]:
    """(block index, offset in block) of each of the first ``num_tokens`` slots."""
    positions = torch.arange(num_tokens, dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks, positions % block_size


class HsxConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector writing one safetensors object per finished request."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._group = find_hidden_state_group(kv_cache_config)
        # The group's own block size: cache_config.block_size is bumped for hybrids.
        self._block_size = kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
        spec = vllm_config.speculative_config
        assert spec is not None
        assert spec.draft_model_config is not None
        self.layer_ids = list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids)
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._base_metadata = object_metadata(extra["model_name"], self.layer_ids, dtype)
        self._extra = extra
        # Scheduler side.
        self._ready: list[PendingSave] = []
        self._held: set[str] = set()
        # Worker side (set up in register_kv_caches, after distributed init).
        self._cache: torch.Tensor | None = None
        self._writer: WriterPool | None = None
        self._queue: deque[PendingSave] = deque()
        self._copied: set[str] = set()
        self._copying: dict[str, Any] = {}  # req_id -> CUDA event of its copy-out
        self._copy_stream: Any = None
        self._pinned = PinnedPool()

    # ==============================
    # Scheduler side
    # ==============================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HsxConnectorMetadata(saves=self._ready)
        self._ready = []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = (
            (request.sampling_params.extra_args or {}).get(REQUEST_ARG)
            if (request.sampling_params)
            else None
        )
        # Not ours, aborted (its caller is gone), or never scheduled: nothing to save.
        if not params or request.status == RequestStatus.FINISHED_ABORTED or not block_ids:
            return False, None
        if params.get("include_output_tokens"):
            # The last token was sampled, never fed back: it has no hidden state.
            token_ids = list(request.all_token_ids)[:-1]
        else:
            token_ids = list(request.prompt_token_ids or [])
        metadata = {**self._base_metadata}
        layers = params.get("layers")
        if layers:
            metadata["layer_ids"] = json.dumps(list(layers))
        metadata.update({k: v for k, v in params.get("metadata", {}).items() if k not in metadata})
        save = PendingSave(request.request_id, params["key"], token_ids, list(block_ids), metadata)
        save.codec, save.layers = params.get("codec", "raw"), layers
        self._ready.append(save)
        self._held.add(request.request_id)
        return True, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None  # never scheduled: no per-group block table
        return self.request_finished(request, block_ids[self._group])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._held.difference_update(connector_output.finished_sending or ())

    def has_pending_block_frees(self) -> bool:
        # Held blocks come back once copied out: wait for them rather than preempt.
        return bool(self._held)

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 reports

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # each token's states together: [blocks, layers, block, hidden]

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        storage = StorageSettings.model_validate(self._extra["storage"])
        self._writer = WriterPool(
            storage,
            CompletionSender(self._extra["completion_address"]),
            max_bytes_in_flight=int(self._extra["max_bytes_in_flight"]),
            max_concurrent_writes=storage.io_threads,
            storage_factory=storage_factory(self._extra.get("storage_factory")),
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # states are read at request finish, so chunked prefill is whole

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._writer is None:
            return None, None  # not rank 0
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, HsxConnectorMetadata):
                self._queue.extend(meta.saves)
        self._start_queued()
        self._poll_copies()
        done, self._copied = self._copied, set()
        return done or None, None

    def _start_queued(self) -> None:
        assert self._writer is not None
        while self._queue:
            save = self._queue[0]
            nbytes = self._host_bytes(save)
            in_flight = self._writer.try_reserve(nbytes)
            if in_flight is None:
                return  # over the ceiling: blocks stay held until writes drain
            self._queue.popleft()
            try:
                job = self._copy_out(save, nbytes, in_flight)
            except Exception as exc:
                self._writer.release(nbytes)
                log.exception("copy-out failed for %s", save.key)
                self._writer.report_failure(save.key, f"copy-out failed: {exc}")
                self._copied.add(save.req_id)
                continue
            self._writer.submit(job)

    def _host_bytes(self, save: PendingSave) -> int:
        """Host memory ``save``'s copy-out takes: what the in-flight ceiling counts.

        On CUDA the codec's device stage runs before the copy, so fp8 and bf16 copies
        are encoded-size; on the CPU the copy is the model-dtype states, and the writer
        counts the object at its encoded size once encoded.
        """
        assert self._cache is not None
        shape = (len(save.token_ids), len(save.layers or self.layer_ids), self._cache.shape[3])
        codec = save.codec if self._cache.is_cuda else "raw"
        return codecs.prepared_nbytes(codec, shape, self._cache.dtype)

    def _layer_index(self, layers: list[int] | None) -> torch.Tensor | None:
        """Positions of ``layers`` in the cache's layer dimension; None for all."""
        if not layers or layers == self.layer_ids:
            return None
        unknown = [i for i in layers if i not in self.layer_ids]
        if unknown:
            raise ValueError(f"layers {unknown} are not served (served: {self.layer_ids})")
        return torch.tensor([self.layer_ids.index(i) for i in layers], dtype=torch.long)

    def _gather(self, blocks: Any, offsets: Any, index: Any) -> torch.Tensor:
        """The states [tokens, layers, hidden] of these slots, as a new tensor."""
        assert self._cache is not None
        if index is None:
            return self._cache[blocks, :, offsets]
        # Only the requested layers are read: fewer bytes copied, not sliced after.
        return self._cache[blocks[:, None], index[None, :], offsets[:, None]]

    def _poll_copies(self) -> None:
        """Requests whose device-to-host copy has completed can give their blocks back."""
        for req_id, event in list(self._copying.items()):
            if event.query():
                del self._copying[req_id]
                self._copied.add(req_id)

    def _copy_out(self, save: PendingSave, nbytes: int, in_flight: int) -> WriteJob:
        assert self._cache is not None
        start = time.perf_counter()
        blocks, offsets = slot_indices(save.block_ids, self._block_size, len(save.token_ids))
        index = self._layer_index(save.layers)
        token_ids = torch.tensor(save.token_ids, dtype=torch.int64)
        job = WriteJob(save.key, None, token_ids, save.metadata, nbytes, 0.0, in_flight)
        job.codec = save.codec
        if self._cache.is_cuda:
            self._copying[save.req_id] = self._copy_out_cuda(job, blocks, offsets, index)
        else:
            # Advanced indexing copies: the result shares nothing with the cache, so
            # the blocks can go back at once.
            job.hidden_states = self._gather(blocks, offsets, index)
            self._copied.add(save.req_id)
        job.copy_s = time.perf_counter() - start
        return job

    def _copy_out_cuda(self, job: WriteJob, blocks: Any, offsets: Any, index: Any) -> Any:
        """Gather and run the codec's device stage on a side stream, then copy into
        reused pinned buffers; returns the copy's event.

        fp8 quantises (bf16 casts) on the GPU, so the copy and the pinned buffers are
        encoded-size. The forward pass is not blocked: the writer thread waits on the
        event, and the blocks go back only once ``_poll_copies`` sees it complete.
        """
        assert self._cache is not None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self._cache.device)
        ready = torch.cuda.Event()
        ready.record()  # after the forward pass that wrote the states
        self._copy_stream.wait_event(ready)
        buffers, hosts = [], {}
        with torch.cuda.stream(self._copy_stream):
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
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        job.hidden_states, job.prepared = hosts["hidden_states"], hosts
        job.wait_ready = done.synchronize

        def release() -> None:
            for buffer in buffers:
                self._pinned.give(buffer)

        job.release = release
        return done

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class PinnedPool:
    """Page-locked host buffers, reused across requests (allocating them is slow).

    Taken by the worker thread, given back by the writer thread after serialising.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer of at least the bytes ``shape`` needs, and a ``dtype`` view of it."""
        numel = shape[0] * shape[1] * shape[2]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            buffer = min(fits, key=lambda b: b.numel()) if fits else None
            if buffer is not None:
                self._free.remove(buffer)
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buffer, buffer[:nbytes].view(dtype).view(shape)

    def give(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` for reuse."""
        with self._lock:
            self._free.append(buffer)
