"""What both halves of the connector share: the step message and the cache geometry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from service.engine.jobs import FailedSave, PendingSave

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["FailedSave", "HsxConnectorMetadata", "PendingSave", "find_hidden_state_group"]


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    """Scheduler-to-worker message of one step: the saves to start, in finishing order
    (a failed one is reported in its turn)."""

    saves: list[PendingSave | FailedSave] = field(default_factory=list)


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
