"""What the engine's workers hold: the KV-cache layout and where memory goes.

``HsxWorkerExtension`` is mixed into vLLM's worker class (``worker_extension_cls``,
vLLM's hook for this), so ``AsyncLLM.collective_rpc("hsx_memory")`` runs in every
worker. Its methods return plain dicts: msgpack carries them without enabling vLLM's
insecure pickle fallback.
vLLM's own metrics say nothing per cache group, and its ``cache_config_info`` has shown
a stale block size for hybrid models; the engine's ``KVCacheConfig`` is the truth.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from service.engine.families import register

# vLLM imports this module in every worker (``worker_extension_cls``) right after its
# own plugins and before it builds the model: hsx's classes for the architectures whose
# vLLM class has no EAGLE-3 interface are registered here (service/engine/families.py).
# Only where vLLM is loaded already: the API process imports this module too (the
# KV-cache metrics) and must not import vLLM for it; it registers in engine_args.
if "vllm" in sys.modules:
    register()

#: Spec class -> the ``kind`` label; anything else gets its class name in snake case.
_KINDS = (
    ("HiddenStateCacheSpec", "hidden_state"),
    ("MambaSpec", "mamba"),
    ("SlidingWindowSpec", "sliding_window"),
    ("ChunkedLocalAttentionSpec", "chunked_local_attention"),
    ("MLAAttentionSpec", "mla_attention"),
    ("FullAttentionSpec", "full_attention"),
)


def spec_kind(spec: Any) -> str:
    """The kind of a KV-cache spec: full_attention, sliding_window, mamba, hidden_state..."""
    names = {cls.__name__ for cls in type(spec).__mro__}
    for class_name, kind in _KINDS:
        if class_name in names:
            return kind
    bare = type(spec).__name__.removesuffix("Spec")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", bare).lower()


def layout_of(kv_cache_config: Any, allocated_bytes: int) -> dict[str, Any]:
    """The layout of a ``KVCacheConfig`` as plain data.

    ``allocated_bytes`` is what the worker really allocated: the config's tensors of a
    hybrid model alias one pool, so summing their sizes would count it once per group.
    A group's ``memory_bytes`` is what its layers address; the groups of a hybrid model
    overlay one pool (a block belongs to one group at a time), so they can add up to
    more than the allocation.
    """
    blocks = int(kv_cache_config.num_blocks)
    groups, hidden = [], 0
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        members = _member_specs(group)
        kinds = sorted({spec_kind(spec) for spec in members})
        memory = sum(int(spec.page_size_bytes) for spec in members) * blocks
        hidden += sum(int(s.page_size_bytes) for s in members if spec_kind(s) == "hidden_state")
        groups.append(
            {
                "index": index,
                "kind": "+".join(kinds),
                "block_size": int(group.kv_cache_spec.block_size),
                "layers": len(group.layer_names),
                "page_size_bytes": int(group.kv_cache_spec.page_size_bytes),
                "memory_bytes": memory,
            }
        )
    return {
        "num_blocks": blocks,
        "memory_bytes": int(allocated_bytes),
        "hidden_state_memory_bytes": hidden * blocks,
        "groups": groups,
    }


def capacity_of(layout: dict[str, Any]) -> dict[str, int]:
    """The KV capacity of one rank from its layout (``layout_of``): ``tokens`` as vLLM
    counts them (blocks shared out evenly between the groups, times the smallest block
    size), the bytes allocated, and the hidden-state layer's share of them. The
    hidden-state layer is not sharded by tensor parallelism: every rank holds the full
    residual stream of the extracted layers (docs/design.md, "KV capacity")."""
    groups = layout["groups"]
    per_group = layout["num_blocks"] // max(len(groups), 1)
    block = min((int(g["block_size"]) for g in groups), default=0)
    tokens = per_group * block
    return {
        "tokens": tokens,
        "memory_bytes": int(layout["memory_bytes"]),
        "hidden_state_memory_bytes": int(layout["hidden_state_memory_bytes"]),
        "bytes_per_token": int(layout["memory_bytes"]) // tokens if tokens else 0,
    }


def _member_specs(group: Any) -> list[Any]:
    """One spec per layer of the group (a uniform-type group carries them per layer)."""
    per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if per_layer:
        return [per_layer[name] for name in group.layer_names]
    return [group.kv_cache_spec] * len(group.layer_names)


class HsxWorkerExtension:
    """Methods vLLM adds to its worker class; ``self`` is the worker."""

    model_runner: Any

    def hsx_kv_layout(self) -> dict[str, Any]:
        """The KV-cache layout of this worker's model runner, with its place (``rank``,
        ``engine``: see ``hsx_memory``)."""
        layout = layout_of(self.model_runner.kv_cache_config, kv_cache_bytes(self.model_runner))
        return {**layout, **self._hsx_place()}

    def hsx_kv_config(self) -> dict[str, Any]:
        """The raw ``KVCacheConfig`` fields, for checks that recompute the layout."""
        config = self.model_runner.kv_cache_config
        return {
            "num_blocks": int(config.num_blocks),
            "tensor_sizes": [int(t.size) for t in config.kv_cache_tensors],
            "groups": [
                {
                    "spec": type(g.kv_cache_spec).__name__,
                    "block_size": int(g.kv_cache_spec.block_size),
                    "page_size_bytes": int(g.kv_cache_spec.page_size_bytes),
                    "layer_names": list(g.layer_names),
                }
                for g in config.kv_cache_groups
            ],
        }

    def hsx_memory(self) -> dict[str, Any]:
        """Device memory, KV cache and weights of this worker, in bytes, with its place:
        ``rank`` (in its engine's world: TP x PP) and ``engine`` (its data-parallel rank),
        so that no two workers' series are alike (every CPU worker's device is ``cpu``)."""
        return {**memory_of(self.model_runner), **self._hsx_place()}

    def _hsx_place(self) -> dict[str, int]:
        parallel = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        # Not ``data_parallel_rank``: vLLM resets that to 0 in each engine of a dense
        # model (its DP ranks run independently); ``data_parallel_index`` keeps the rank.
        engine = getattr(parallel, "data_parallel_index", None)
        if engine is None:
            engine = getattr(parallel, "data_parallel_rank", 0)
        return {"rank": int(getattr(self, "rank", 0) or 0), "engine": int(engine or 0)}


def memory_of(runner: Any) -> dict[str, Any]:
    """Device memory, KV cache and model weights of one model runner, in bytes."""
    import torch

    model = runner.get_model()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    device = next(model.parameters()).device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = f"cuda:{device.index or 0}"
    else:
        import psutil

        memory = psutil.virtual_memory()
        free, total, name = memory.available, memory.total, "cpu"
    return {
        "device": name,
        "total_bytes": int(total),
        "free_bytes": int(free),
        "used_bytes": int(total - free),
        "kv_cache_bytes": kv_cache_bytes(runner),
        "model_weights_bytes": int(weights),
    }


def kv_cache_bytes(runner: Any) -> int:
    """Bytes of the KV-cache storage the runner allocated (shared storage counted once)."""
    storages = {}
    for tensor in _kv_tensors(runner):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return int(sum(storages.values()))


def _kv_tensors(runner: Any) -> list[Any]:
    caches = getattr(runner, "kv_caches", None) or []
    found: list[Any] = []
    for entry in caches:
        found.extend(entry if isinstance(entry, list | tuple) else [entry])
    return [t for t in found if hasattr(t, "untyped_storage")]
