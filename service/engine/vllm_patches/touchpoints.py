"""The touch points hsx does not patch: vLLM internals it reads, builds on or sets.

Nothing here is installed; the fingerprints are read by the canary
(``python -m service.engine.vllm_patches.canary``) against each vLLM release, and listed
in docs/vllm-coupling.md with the patches. The code they describe lives where it works
(``hsx`` names it).
"""

from __future__ import annotations

from service.engine.vllm_patches.fingerprints import (
    ABSENT,
    ALL_MATCH,
    ALL_PRESENT,
    ALL_RESOLVE,
    Binders,
    Calls,
    Digest,
    Imports,
    Members,
    Names,
    Overrides,
    Params,
    Wording,
)
from service.engine.vllm_patches.registry import CPU_ONLY, EVERY_HOST, READ, RUN, Kind, TouchPoint

BOTH = {"0.32.0": RUN, "0.33.0": READ}
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_MODEL = "vllm.model_executor.models.extract_hidden_states"
_SAME = {"0.32.0": ALL_PRESENT, "0.33.0": ALL_PRESENT}


def _same(observed: str) -> dict[str, str]:
    """``observed`` accepted for both versions checked."""
    return dict.fromkeys(("0.32.0", "0.33.0"), observed)


#: KVConnectorBase_V1's methods in vLLM 0.32.0; 0.33.0 adds the sleep-mode hooks.
_HOOKS_0_32 = """
    __init__ _get_connector_metadata bind_connector_metadata bind_gpu_block_pool
    bind_kv_cache_manager build_connector_meta build_connector_worker_meta
    build_kv_connector_stats build_prom_metrics clear_connector_metadata
    finish_forward get_block_ids_with_load_errors get_external_cache_hit_sources
    get_finished get_finished_count get_handshake_metadata
    get_kv_connector_kv_cache_events get_kv_connector_stats
    get_loaded_kv_cache_group_ids get_mem_pool_context get_num_new_matched_tokens
    get_required_kvcache_layout get_transfer_results handle_preemptions
    has_connector_metadata has_pending_block_frees has_pending_push_work
    on_new_request register_finished_partial_tail register_kv_caches
    request_finished requires_kv_delivery requires_piecewise_for_cudagraph
    reset_cache reset_capture_state role save_kv_layer set_host_xfer_buffer_ops
    set_xfer_handshake_metadata set_xfer_handshake_metadata_pp_aware shutdown
    start_load_kv supports_divergent_local_hybrid_hits take_events
    update_connector_output update_state_after_alloc wait_for_layer_load
    wait_for_save
"""
_BASE_HOOKS = tuple(_HOOKS_0_32.split())
_SLEEP_HOOKS = ("restore_kv_caches", "supports_sleep_mode", "unregister_kv_caches")

CONNECTOR = TouchPoint(
    name="connector-hooks",
    kind=Kind.READS,
    hsx="service/engine/connector/__init__.py",
    target=f"{_BASE}.KVConnectorBase_V1 and SupportsHMA: the hooks hsx implements, and "
    "those it leaves to the base",
    why="hsx's connector is vLLM's public plug-in point; a new hook may need an answer "
    "(0.33's supports_sleep_mode: hsx answers False and refuses enable_sleep_mode)",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Members(
            f"{_BASE}:KVConnectorBase_V1",
            {
                "0.32.0": ", ".join(_BASE_HOOKS),
                "0.33.0": ", ".join(sorted(_BASE_HOOKS + _SLEEP_HOOKS)),
            },
        ),
        Members(f"{_BASE}:SupportsHMA", _same("request_finished_all_groups")),
        Overrides(
            f"{_BASE}:KVConnectorBase_V1,SupportsHMA",
            {"0.32.0": "supports_sleep_mode: not in the base", "0.33.0": ALL_MATCH},
            hsx_class="service.engine.connector:HsxConnector",
        ),
    ),
    notes={
        "0.33.0": "the base gains supports_sleep_mode (default True), unregister_kv_caches "
        "and restore_kv_caches, called around sleep and wake; hsx answers "
        "supports_sleep_mode with False and refuses enable_sleep_mode at start-up"
    },
)

EXTRACTION = TouchPoint(
    name="extraction-model",
    kind=Kind.READS,
    hsx="service/engine/connector/common.py, worker.py",
    target=f"{_MODEL} (CacheOnlyAttentionLayer, the model) and "
    "vllm.v1.kv_cache_interface.HiddenStateCacheSpec",
    why="the hidden states hsx copies out are what this model caches, in this layer's cache group",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Digest(f"{_MODEL}:CacheOnlyAttentionLayer", _same("0591603b976c7322")),
        Digest(f"{_MODEL}:CacheOnlyAttentionImpl", _same("da8742e564101d98")),
        Digest(f"{_MODEL}:ExtractHiddenStatesModel", _same("b0900b315b4d09ed")),
        Digest("vllm.v1.kv_cache_interface:HiddenStateCacheSpec", _same("ba014a15c2bc6d60")),
    ),
)

BIND = TouchPoint(
    name="saves-start-at-bind",
    kind=Kind.READS,
    hsx="service/engine/connector/__init__.py (bind_connector_metadata)",
    target="the model runners bind the connector's metadata every step before the "
    "forward: V1 (KVConnectorModelRunnerMixin, CPU) and V2 (ActiveKVConnector, GPU)",
    why="hsx starts a step's copies when the metadata is bound, so they overlap the forward pass",
    platforms=EVERY_HOST,
    checked_on={"0.32.0": RUN + " (V1 runner; V2 not run on GPU)", "0.33.0": READ},
    fingerprints=(
        Digest(
            "vllm.v1.worker.kv_connector_model_runner_mixin:"
            "KVConnectorModelRunnerMixin._get_kv_connector_output",
            _same("cc65f9e296f515f3"),
        ),
        Digest(
            "vllm.v1.worker.gpu.kv_connector:ActiveKVConnector.pre_forward",
            _same("c48b04d1843da815"),
        ),
    ),
)

REQUESTS = TouchPoint(
    name="request-internals",
    kind=Kind.READS,
    hsx="service/engine/connector/scheduler.py, vllm_patches/drafts.py",
    target="vllm.v1.request.Request's fields",
    why="the scheduler half keys, sizes and validates each save from the finished request",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Names(
            "vllm.v1.request",
            _SAME,
            names=tuple(
                f"Request.{field}"
                for field in (
                    "request_id",
                    "prompt_token_ids",
                    "all_token_ids",
                    "sampling_params",
                    "status",
                    "is_finished",
                    "is_prefill_chunk",
                    "spec_token_ids",
                )
            ),
        ),
    ),
)

INTROSPECTION = TouchPoint(
    name="worker-introspection",
    kind=Kind.READS,
    hsx="service/engine/introspect.py",
    target="the model runner's kv_cache_config and kv_caches (V1 and V2 runners)",
    why="the KV-cache metrics describe the groups and the memory the worker holds",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Names(
            "vllm.v1.worker.gpu_model_runner",
            _SAME,
            names=("GPUModelRunner.kv_cache_config", "GPUModelRunner.kv_caches"),
        ),
        Names(
            "vllm.v1.worker.gpu.model_runner",
            _SAME,
            names=("GPUModelRunner.kv_cache_config", "GPUModelRunner.kv_caches"),
        ),
    ),
)

CLIENT = TouchPoint(
    name="engine-client-internals",
    kind=Kind.READS,
    hsx="service/engine/extractor.py",
    target="AsyncMPClient.call_utility_all_async, core_engines, BackgroundResources"
    "(ctx, engine_manager), CoreEngineProcManager.processes",
    why="metrics from every data-parallel engine; releasing the ZMQ context and process "
    "objects vLLM's shutdown leaves open",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Names(
            "vllm.v1.engine.core_client",
            _SAME,
            names=(
                "AsyncMPClient.call_utility_all_async",
                "MPClient.core_engines",
                "MPClient.resources",
                "BackgroundResources.ctx",
                "BackgroundResources.engine_manager",
            ),
        ),
        Names("vllm.v1.engine.utils", _SAME, names=("CoreEngineProcManager.processes",)),
    ),
)

SIGTERM = TouchPoint(
    name="engine-sigterm",
    kind=Kind.READS,
    hsx="service/engine/lifeline.py",
    target="the EngineCore's SIGTERM handler (vllm.v1.engine.core)",
    why="the lifeline stops an orphaned EngineCore the way its parent's SIGTERM would",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Calls(
            "vllm.v1.engine.core:signal.signal",
            _same("; ".join(["EngineCoreProc.run_engine_core: 2"] * 4)),
        ),
    ),
)

API = TouchPoint(
    name="vllm-imports",
    kind=Kind.READS,
    hsx="service/ (api/routes/openai.py, api/extractor.py, engine/front_end.py, ...)",
    target="every name hsx imports from vLLM: protocol models, renderer and serving "
    "entry points, engine classes",
    why="the OpenAI routes take vLLM's own request models and renderer",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(Imports("service", {"0.32.0": ALL_RESOLVE, "0.33.0": ALL_RESOLVE}),),
)

_CPU_WORKER = "vllm.v1.worker.cpu_worker"
_UTILS = "vllm.v1.engine.utils"
#: Where vLLM's KV-cache size check lives (0.33 moved it).
_KV_CHECK = {"0.32.0": "vllm.v1.core.kv_cache_utils", "0.33.0": "vllm.v1.core.kv_cache_planning"}
MESSAGES = TouchPoint(
    name="start-up-messages",
    kind=Kind.READS,
    hsx="service/startup.py (from_engine)",
    target="the wording of vLLM's start-up failures, matched to name the setting to change",
    why="vLLM's engine dies in a child process; its message is the only account of why",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Wording(
            "max seq len ({}), ({} GiB KV cache is needed, which is larger than the "
            "available KV cache memory ({} GiB). ",
            _KV_CHECK,
        ),
        Wording("the estimated maximum model length is {}. ", _KV_CHECK),
        Wording("No available memory for the cache blocks. ", _KV_CHECK),
        Wording(
            "Available memory on node {} ({}/{} GiB) on kv cache allocation is less than "
            "requested memory for kv ({}",
            _same(_CPU_WORKER),
        ),
        Wording(
            "Available memory on node {} ({}/{} GiB) on startup is less than desired CPU "
            "memory utilization ({}, {} GiB). ",
            {"0.32.0": _CPU_WORKER, "0.33.0": ABSENT},
        ),
        Wording(
            "The worker already uses {} GiB (model weights and runtime), more than the {} "
            "GiB of CPU memory reserved for it on node {}, leaving none for the KV cache. ",
            {"0.32.0": ABSENT, "0.33.0": _CPU_WORKER},
        ),
        Wording(
            "Not enough allowed NUMA nodes to bind threads of {} local CPUWorkers. ",
            _same("vllm.utils.ompmultiprocessing"),
        ),
    ),
    notes={
        "0.33.0": "the CPU worker's start-up utilisation check is gone (its branch in "
        "startup.py serves 0.32 only); a worker whose own footprint fills its reservation "
        "has a new message, named as engine.gpu_memory_utilization; the KV-cache check "
        "moved to v1/core/kv_cache_planning.py, same wording"
    },
)

TEST_IMPORT = TouchPoint(
    name="test-kv-cache-check",
    kind=Kind.READS,
    hsx="tests/e2e/test_startup_errors.py",
    target="vLLM's private _check_enough_kv_cache_memory, called for its real message",
    why="the start-up message test feeds from_engine vLLM's own words, not a copy",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(Binders("_check_enough_kv_cache_memory", _KV_CHECK),),
    notes={"0.33.0": "moved to v1/core/kv_cache_planning.py; the test imports either"},
)

CPU_SETTINGS = TouchPoint(
    name="cpu-process-settings",
    kind=Kind.SETS,
    hsx="service/engine/builder.py, allocator.py, hugepages.py",
    target="VLLM_WORKER_MULTIPROC_METHOD=fork for 16-bit dtypes, VLLM_CPU_OMP_THREADS_BIND "
    "per rank, kv_cache_memory_bytes; glibc's mallopt and torch's THP_MEM_ALLOC_ENABLE in "
    "vLLM's CPU workers",
    why="spawned bf16 workers died with SIGILL; vLLM binds one rank per NUMA node; a "
    "fixed KV cache starts on a loaded machine; a steady heap and huge pages for speed",
    platforms=CPU_ONLY,
    checked_on=BOTH,
)

_EXECUTOR = "vllm.v1.executor.multiproc_executor"
WORKER_FAILURE = TouchPoint(
    name="worker-start-up-traceback",
    kind=Kind.READS,
    hsx="service/engine/root_cause.py (from service/startup.py's from_engine)",
    target="the traceback vLLM's worker logs when it fails to start, and the wrappers "
    "its parents raise in its place",
    why="the worker's own exception is the root cause; the parent only hears that a "
    "background process failed",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Wording("WorkerProc failed to start.", _same(_EXECUTOR)),
        Wording(
            "WorkerProc initialization failed due to an exception in a background "
            "process. See stack trace for root cause.",
            _same(_EXECUTOR),
        ),
        Wording("Engine core initialization failed. See root cause above. ", _same(_UTILS)),
    ),
)

_MODELS = "vllm.model_executor.models"
_INTERFACES = f"{_MODELS}.interfaces"
MODEL_CLASSES = TouchPoint(
    name="extraction-model-classes",
    kind=Kind.SETS,
    hsx="service/engine/models.py, families.py (registered from introspect.py)",
    target=f"{_MODELS}.registry.ModelRegistry (register_model) in every worker: hsx's "
    "subclasses of FalconH1ForCausalLM and Gemma3ForCausalLM with EAGLE-3's "
    "aux-hidden-state interface (SupportsEagle3), captured by hooks on their decoder "
    "layers as EagleModelMixin._maybe_add_hidden_state adds them",
    why="extract_hidden_states reads states through SupportsEagle3, which these vLLM "
    "classes lack; registration is vLLM's public way to serve another class for an "
    "architecture, and the hooks leave vLLM's code as it is",
    platforms=EVERY_HOST,
    checked_on=BOTH,
    fingerprints=(
        Params(
            f"{_MODELS}.registry:_ModelRegistry.register_model",
            _same("self, model_arch, model_cls"),
        ),
        Digest(f"{_INTERFACES}:EagleModelMixin._maybe_add_hidden_state", _same("50298fd1e4eff9cd")),
        Digest(f"{_INTERFACES}:SupportsEagle3", _same("ba1f7f8b5233e08f")),
        Digest(
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner._setup_eagle3_aux_hidden_state_outputs",
            _same("1d89da0b9452b18f"),
        ),
        Digest(
            "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker",
            {"0.32.0": "4513d6fa5d1808b8", "0.33.0": "31e3b37cf1da606d"},
        ),
        Digest(f"{_MODELS}.falcon_h1:FalconH1Model.forward", _same("faf30f88ce3d693f")),
        Digest(f"{_MODELS}.falcon_h1:FalconH1ParallelHybrid.forward", _same("0f8df4395395bdd8")),
        Digest(f"{_MODELS}.gemma3:Gemma3Model.forward", _same("ab2b05806bb74a21")),
        Digest(f"{_MODELS}.gemma3:Gemma3DecoderLayer.forward", _same("7df6f80fc9d6d5fd")),
        Wording(
            "CPU GDN attention requires BF16",
            _same("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"),
        ),
    ),
    notes={
        "0.33.0": "WorkerWrapperBase.init_worker also keeps the extension class; it is "
        "still imported before the model is built. The CPU GatedDeltaNet kernel runs "
        "float16 too where triton-cpu is installed (service/engine/families.py's "
        "CPU_DTYPES, checked on 0.32, still allows bfloat16 only)"
    },
)

READ_ONLY: tuple[TouchPoint, ...] = (
    CONNECTOR,
    EXTRACTION,
    BIND,
    REQUESTS,
    INTROSPECTION,
    CLIENT,
    SIGTERM,
    API,
    MESSAGES,
    TEST_IMPORT,
    CPU_SETTINGS,
    WORKER_FAILURE,
    MODEL_CLASSES,
)
