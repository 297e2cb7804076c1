"""hsx's KV connector: copies each request's hidden states out of vLLM's KV cache.

Used with the ``extract_hidden_states`` speculative method, which caches the chosen
layers' hidden states in a cache group of their own (``HiddenStateCacheSpec``). As in
vLLM's own connectors, :class:`HsxConnector` is a thin shell: vLLM builds one per role
and it delegates to the half for that role. Life of one request:

Scheduler half (EngineCore process, ``scheduler.py``)
  1. ``request_finished_all_groups``: the request finished. If it is ours (it carries
     ``extra_args["hsx"]``, a :class:`~service.engine.wire.RequestParams`) and was not
     aborted, hold its blocks (return True) and queue a save: key, token ids,
     hidden-state block ids.
  2. ``build_connector_meta``: hand queued saves to the workers with the next step.
  3. ``update_connector_output``: the workers reported a request copied out; its
     blocks are freed by vLLM, we forget it.

Worker half (``worker.py``)
  4. ``bind_connector_metadata``, before the step's forward pass: for each new save,
     reserve room under the in-flight ceiling, gather the request's slots from the
     hidden-state cache, copy them to host memory (CUDA: side stream into a reused
     pinned buffer; CPU: a plain copy) and hand the object to the writer pool, which
     writes it while the forward pass runs. Requests over the ceiling wait, blocks
     still held. ``get_finished``, after it: start the saves that waited, report copied
     requests as finished sending so vLLM frees their blocks.
  5. The writer pool (``service.engine.writer``) validates, serialises and writes
     through ``service.storage`` and pushes a completion (the stored object, or why
     not) to the API process.

Only tensor-parallel rank 0 copies and writes; ``get_finished_count`` is 1 so vLLM
waits for rank 0 alone. Sleep mode is refused (``supports_sleep_mode``): the worker half
holds the hidden-state cache tensor and pinned copy buffers that sleep would free or
remap under it. What vLLM's example connector got right is kept (group found
by spec type, its own block size, save at finish so chunked prefill works); what it
lacked is added (no CUDA calls on CPU, storage behind our interface, failures reported
to the caller, keys made by the server, bounded memory, a drained shutdown).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from service.engine.connector.common import HsxConnectorMetadata, find_hidden_state_group
from service.engine.lifeline import exit_with_parent, exit_without_a_heap_scan, shut_down_cleanly
from service.engine.vllm_patches import mamba_padding
from service.engine.vllm_patches.drafts import skip_unused_draft_fetches
from service.engine.wire import ConnectorConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from service.engine.connector.scheduler import HsxConnectorScheduler
    from service.engine.connector.worker import HsxConnectorWorker

__all__ = ["HsxConnector"]


class HsxConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector writing one safetensors object per finished request."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        group = find_hidden_state_group(kv_cache_config)
        self._scheduler: HsxConnectorScheduler | None = None
        self._worker: HsxConnectorWorker | None = None
        exit_without_a_heap_scan()
        if role == KVConnectorRole.SCHEDULER:
            from service.engine.connector.scheduler import HsxConnectorScheduler

            spec = vllm_config.speculative_config
            assert spec is not None
            assert spec.draft_model_config is not None
            layer_ids = list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids)
            dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
            self._scheduler = HsxConnectorScheduler(
                group, config.model_name, layer_ids, dtype, config.provenance
            )
            # The scheduler half lives in the EngineCore: the one process vLLM leaves
            # running when the server is killed outright.
            exit_with_parent()
            # Most of hsx's requests finish with their prompt: their drafts go unused.
            skip_unused_draft_fetches()
            # A Mamba model's new one-token prompt gets no placeholder draft.
            mamba_padding.install(kv_cache_config)
        else:
            from service.engine.connector.worker import HsxConnectorWorker

            # The group's own block size: cache_config.block_size is bumped for hybrids.
            block_size = kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
            self._worker = HsxConnectorWorker(vllm_config, config, block_size)

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
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 reports

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # each token's states together: [blocks, layers, block, hidden]

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """False: sleep would free or remap the KV cache while the worker half holds
        its hidden-state tensor and pinned copy buffers (vLLM 0.33 asks; on 0.32 hsx
        refuses ``enable_sleep_mode`` itself, ``service.engine.sleep_mode``)."""
        return False

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # states are read at request finish, so chunked prefill is whole

    def wait_for_save(self) -> None:
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata and start its saves, before the forward pass (the
        model runner binds every step, forward or not, before anything else)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, HsxConnectorMetadata):
            self._worker.start(connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(), None

    def shutdown(self) -> None:
        shut_down_cleanly()  # vLLM's shutdown reached us: the exit may skip the heap scan
        if self._worker is not None:
            self._worker.shutdown()
