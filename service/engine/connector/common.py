"""What both halves of the connector share: the step message and the cache geometry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from service.codecs import Codec
from service.engine.wire import FailureType

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class PendingSave:
    """One finished request whose hidden states must be copied out and written.

    ``failure`` is set when the request's parameters were unusable: the worker then
    reports it under ``key`` without copying anything.
    """

    req_id: str
    key: str
    token_ids: list[int]
    block_ids: list[int]
    metadata: dict[str, str]
    failure: str | None = None
    failure_type: FailureType = "internal_error"
    """The error type a caller sees for ``failure`` (``invalid_request``: the prompt's)."""
    loss_spans: list[tuple[int, int]] | None = None
    """Supervised ``[start, end)`` ranges of ``token_ids``: write a ``loss_mask``."""
    codec: Codec = "raw"
    """How the object stores its states (``service.codecs``)."""
    layer_index: list[int] | None = None
    """Positions in the cache's layer dimension of the layers to store; None: all."""


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
