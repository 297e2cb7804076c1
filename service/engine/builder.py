"""vLLM engine arguments from hsx settings: layer ids, memory, prefix caching, connector."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import EngineSettings, Settings
from service.engine.families import WRAPPED, register
from service.engine.metrics import ExtractorMetrics
from service.engine.parallel import BIND_VARIABLE, cpu_binding, pipeline_refusal
from service.engine.provenance import Provenance, build_provenance
from service.engine.sleep_mode import sleep_mode_refusal
from service.engine.wire import ConnectorConfig
from service.storage import Storage, open_storage, scheme_of

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "HsxConnector"
CONNECTOR_MODULE = "service.engine.connector"
#: KV-cache size on CPU when the user sets neither it nor a utilisation (docs/cpu.md).
DEFAULT_CPU_KVCACHE_GIB = 1.0
GIB = 1024**3
# Families whose vLLM classes keep Mamba / linear-attention state beside attention.
_HYBRID_TYPES = {"nemotron_h", "qwen3_next", "jamba", "bamba", "falcon_h1", "zamba2", "plamo2"}


@dataclass(frozen=True)
class ModelInfo:
    """What the served model is: read from its config before the engine starts."""

    name: str
    num_layers: int
    hidden_size: int
    hybrid: bool
    vocab_size: int = 0  # rows of the embedding; 0 when the config does not say
    revision: str | None = None  # the checkpoint's (hub commit hash), when known
    architecture: str = ""  # the config's first architecture (Qwen3NextForCausalLM)
    model_type: str = ""  # the (text) config's model_type (qwen3_next)
    config_dtype: str | None = None  # the dtype the config declares (float32), if any


def read_model_info(model: str, name: str | None = None) -> ModelInfo:
    """Read layer count, hidden size and hybrid-ness from the model's config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", config)
    layer_types = getattr(text, "layers_block_type", None) or getattr(text, "layer_types", None)
    hybrid = text.model_type in _HYBRID_TYPES or any(
        "mamba" in str(t) or "linear" in str(t) for t in (layer_types or ())
    )
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    revision = getattr(config, "_commit_hash", None) or getattr(config, "revision", None)
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    return ModelInfo(
        name or model,
        int(text.num_hidden_layers),
        int(text.hidden_size),
        hybrid,
        vocab,
        str(revision) if revision else None,
        architecture=(getattr(config, "architectures", None) or [""])[0],
        model_type=str(text.model_type),
        config_dtype=str(dtype).removeprefix("torch.") if dtype else None,
    )


@dataclass(frozen=True)
class Prepared:
    """What start-up proved before the engine starts, handed to it so nothing is read or
    opened twice: the model's config (``info``), the layer ids resolved against it, and
    the storage opened (instrumented into ``metrics.storage``), and the server's
    provenance (built once, before the engine: the workers get it whole)."""

    info: ModelInfo
    layer_ids: list[int]
    storage: Storage
    metrics: ExtractorMetrics
    provenance: Provenance


def prepare(settings: Settings, storage_factory: str | None = None) -> Prepared:
    """Read the model's config, resolve the layer ids and open the storage, unchecked
    (``hsx serve`` checks each step first, ``service.startup``; tests and benchmarks
    start engines with this). Raises ValueError for no model, bad layer ids or pipeline
    parallelism (before the storage opens)."""
    model = settings.engine.model
    if model is None:
        raise ValueError("engine.model is not set")
    check_pipeline_parallel(settings.engine)
    info = read_model_info(model)
    layer_ids = resolve_layer_ids(settings.engine.layer_ids, info.num_layers)
    provenance = build_provenance(model, info.revision)
    metrics = ExtractorMetrics(scheme_of(settings.storage.url))
    storage = open_storage(settings.storage.for_reader(), metrics.storage, factory=storage_factory)
    return Prepared(info, layer_ids, storage, metrics, provenance)


def served_model_name(model: str) -> str:
    """The name clients and metrics see: a local model's directory name (never the
    server's path), or the Hugging Face id as given."""
    path = Path(model)
    return path.name if path.is_absolute() or path.exists() else model


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 practice: [2, L//2, L-3, L], deduplicated and clipped for tiny models."""
    wanted = [2, num_layers // 2, num_layers - 3, num_layers]
    return sorted({min(max(i, 0), num_layers) for i in wanted})


def resolve_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """The layer ids to extract; refuses ids the model does not have."""
    if requested is None:
        return default_layer_ids(num_layers)
    bad = [i for i in requested if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"layer_ids {bad} are out of range: this model has {num_layers} decoder layers, "
            f"so ids 0..{num_layers} are allowed (0 = embeddings, {num_layers} = final "
            "output before the norm)"
        )
    return list(requested)


def check_pipeline_parallel(engine: EngineSettings) -> None:
    """Refuse more than one pipeline stage, from the setting or ``extra_args``, with the
    words of ``hsx serve``'s start-up check (``service.startup``): ValueError."""
    if (refusal := pipeline_refusal(engine)) is not None:
        raise ValueError(f"{refusal.setting}: {refusal.problem}; {refusal.fix}")


def check_sleep_mode(engine: EngineSettings) -> None:
    """Refuse ``enable_sleep_mode`` in ``extra_args`` with the words of ``hsx serve``'s
    start-up check (``service.engine.sleep_mode``): ValueError."""
    if (refusal := sleep_mode_refusal(engine)) is not None:
        raise ValueError(f"{refusal.setting}: {refusal.problem}; {refusal.fix}")


def pipeline_args(engine: EngineSettings) -> dict[str, Any]:
    """``pipeline_parallel_size`` for vLLM only when it is not 1, which
    ``check_pipeline_parallel`` refuses today: the engine args keep vLLM's default until
    hsx supports pipeline parallelism (docs/design.md)."""
    size = engine.pipeline_parallel_size
    return {} if size == 1 else {"pipeline_parallel_size": size}


def usage_context() -> Any:
    """The ``UsageContext`` hsx's engine is built for: vLLM's OpenAI server's.

    vLLM picks the default tokens per step and sequences per step by it
    (``EngineArgs.get_batch_defaults``). ``AsyncLLM.from_engine_args`` defaults to
    ``ENGINE_CONTEXT``, which has no entry there and falls back to 2,048 tokens and 128
    sequences on every device, where ``vllm serve`` gets 8,192 and 1,024 on an H100 or
    H200 (16,384 on GPUs of 160 GB or more): a server that only prefills would run
    steps a quarter of the size. On CPU both contexts give 2,048 and 128. Read in vLLM
    0.32's and 0.33's ``arg_utils.py``; not run on a GPU."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def engine_args(
    settings: Settings,
    info: ModelInfo,
    layer_ids: list[int],
    completion_address: str,
    storage_factory: str | None = None,
    provenance: Provenance | None = None,
    *,
    completion_secret: str | None = None,
) -> Any:
    """``AsyncEngineArgs`` running ``extract_hidden_states`` with our connector, whose
    writer tags its completions with ``completion_secret`` (the receiver's; None: a
    fresh one nobody listens for). Raises ValueError for pipeline parallelism
    (``check_pipeline_parallel``) and sleep mode (``check_sleep_mode``)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    register()  # this process resolves the architecture too (the workers: introspect)

    engine = settings.engine
    check_pipeline_parallel(engine)  # no path reaches vLLM with more than one stage
    check_sleep_mode(engine)  # nor with sleep mode, which vLLM 0.32 would not refuse
    cpu = on_cpu()
    if cpu and engine.dtype in ("bfloat16", "float16"):
        # Spawned CPU workers died with SIGILL in bf16 (docs/cpu.md); fork works.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    prefix_caching = engine.enable_prefix_caching
    if prefix_caching is None:
        # Hybrid prefix caching takes a Mamba "align" path through Triton: GPU only.
        prefix_caching = not (info.hybrid and cpu)
    connector = ConnectorConfig(
        model_name=served_model_name(info.name),
        completion_address=completion_address,
        **({} if completion_secret is None else {"completion_secret": completion_secret}),
        storage=settings.storage,
        max_bytes_in_flight=settings.limits.max_bytes_in_flight,
        storage_factory=storage_factory,
        provenance=provenance,
    )
    return AsyncEngineArgs(
        model=engine.model,
        served_model_name=[served_model_name(info.name)],
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        tensor_parallel_size=engine.tensor_parallel_size,
        data_parallel_size=engine.data_parallel_size,
        enable_prefix_caching=prefix_caching,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer",
            kv_connector_extra_config=connector.to_extra_config(),
        ),
        **{
            "worker_extension_cls": WORKER_EXTENSION,
            **pipeline_args(engine),
            **memory_args(engine, cpu),
            **engine.extra_args,
            **eager_args(info),
        },
    )


def eager_args(info: ModelInfo) -> dict[str, Any]:
    """``enforce_eager`` for an architecture hsx wraps (``service.engine.models``): its
    states are captured by Python hooks, which a compiled or graph-replayed forward would
    not call (the states would be stale). It overrides ``extra_args``."""
    if info.architecture not in WRAPPED:
        return {}
    log.info("hsx: %s runs eagerly: hsx captures its states with hooks", info.architecture)
    return {"enforce_eager": True}


def bind_cpu_workers(ranks: int) -> None:
    """On CPU, give each of ``ranks`` workers its own CPUs (``VLLM_CPU_OMP_THREADS_BIND``,
    which the engine's processes inherit) unless the user chose a binding: vLLM's
    default binds one rank per NUMA node and refuses more ranks than nodes. Called
    where an engine starts (``Extractor.start``), not where its arguments are built."""
    if ranks <= 1 or BIND_VARIABLE in os.environ or not on_cpu():
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    try:
        binding = cpu_binding(ranks, cpus or list(range(os.cpu_count() or 1)))
    except ValueError as exc:  # vLLM's own binding then refuses, named at start-up
        log.warning("hsx: %s; leaving %s to vLLM", exc, BIND_VARIABLE)
        return
    os.environ[BIND_VARIABLE] = binding
    log.info("hsx: %s=%s (%d CPU workers)", BIND_VARIABLE, binding, ranks)


def memory_args(engine: EngineSettings, on_cpu: bool) -> dict[str, Any]:
    """vLLM's memory arguments: on CPU a fixed KV-cache size unless the user sizes it.

    vLLM's CPU worker reads ``gpu_memory_utilization`` (default 0.9) as a share of NUMA
    node 0 that it reserves; vLLM 0.32 also refuses to start unless that share is free
    when the worker starts (``CPUWorker.__init__``; 0.33 dropped that check), which on
    a loaded machine fails however small the model. With ``kv_cache_memory_bytes`` set
    it only asks that the cache itself fits in the node's free memory
    (``determine_available_memory`` in vllm/v1/worker/cpu_worker.py). A user's
    ``VLLM_CPU_KVCACHE_SPACE`` still wins: vLLM's platform applies it after these.
    """
    args: dict[str, Any] = {}
    if engine.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = engine.gpu_memory_utilization
    if on_cpu:
        gib = engine.cpu_kvcache_space_gib
        if gib is None and engine.gpu_memory_utilization is None:
            gib = DEFAULT_CPU_KVCACHE_GIB
        if gib is not None:
            args["kv_cache_memory_bytes"] = int(gib * GIB)
    return args


#: Adds hsx's introspection methods to vLLM's worker (see service.engine.introspect).
WORKER_EXTENSION = "service.engine.introspect.HsxWorkerExtension"


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
