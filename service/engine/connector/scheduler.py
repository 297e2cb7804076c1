"""The connector's scheduler half (EngineCore process): which blocks to hold and save."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from service.codecs import TOKENS_KEY
from service.engine.connector.common import FailedSave, HsxConnectorMetadata, PendingSave
from service.engine.objects import object_metadata
from service.engine.provenance import Provenance
from service.engine.wire import (
    REQUEST_ARG,
    RequestParams,
    WriteFailure,
    is_pooled,
    selected_positions,
    selection_json,
)

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """What this server stores for every request: its model, layer ids and dtype, and
    the provenance every object's metadata carries (None: none)."""

    model: str
    layer_ids: tuple[int, ...]
    dtype: str
    provenance: Provenance | None = None


class HsxConnectorScheduler:
    """Holds each finished hsx request's blocks and queues its save for the workers."""

    def __init__(
        self,
        group: int,
        model_name: str,
        layer_ids: Sequence[int],
        dtype: str,
        provenance: Provenance | None = None,
    ) -> None:
        self._group = group
        self._served = Served(model_name, tuple(layer_ids), dtype, provenance)
        self._ready: list[PendingSave | FailedSave] = []
        self._held: set[str] = set()

    def build_connector_meta(self) -> HsxConnectorMetadata:
        """The saves queued since the last step, handed to the workers with this one."""
        meta = HsxConnectorMetadata(saves=self._ready)
        self._ready = []
        return meta

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """``request_finished`` with the hidden-state group's blocks."""
        if not 0 <= self._group < len(block_ids):
            return False, None  # never scheduled: no per-group block table
        return self.request_finished(request, block_ids[self._group])

    def request_finished(self, request: Request, blocks: list[int]) -> tuple[bool, None]:
        """Hold the request's blocks and queue its save, if it is ours and completed."""
        from vllm.v1.request import RequestStatus

        extra_args = (request.sampling_params.extra_args if request.sampling_params else None) or {}
        # Not ours, aborted (its caller is gone), or never scheduled: nothing to save.
        if not extra_args.get(REQUEST_ARG) or not blocks:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        self._ready.append(self._save(request, extra_args, blocks))
        self._held.add(request.request_id)
        return True, None

    def _save(
        self, request: Request, extra_args: dict[str, Any], blocks: Sequence[int]
    ) -> PendingSave | FailedSave:
        try:
            params = RequestParams.from_extra_args(extra_args)
        except ValidationError as exc:
            # Only our Extractor sets these, so this is a bug; fail the prompt, not the engine.
            log.error("malformed hsx request parameters: %s", exc)
            raw = extra_args.get(REQUEST_ARG)
            key = str(raw.get("key", "")) if isinstance(raw, dict) else ""
            failure = WriteFailure(type="internal_error", message=str(exc))
            return FailedSave(request.request_id, key, failure)
        assert params is not None
        planned = plan_save(request, blocks, params, self._served)
        if isinstance(planned, WriteFailure):
            return FailedSave(request.request_id, params.key, planned)
        return planned

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Requests the workers copied out: vLLM frees their blocks now."""
        self._held.difference_update(connector_output.finished_sending or ())

    def has_pending_block_frees(self) -> bool:
        """Held blocks come back once copied out: vLLM waits for them rather than preempt."""
        return bool(self._held)


def plan_save(
    request: Request, blocks: Sequence[int], params: RequestParams, served: Served
) -> PendingSave | WriteFailure:
    """The save of a finished request of ours: which tokens, positions, layers and blocks
    to copy and how to write them, or why it gets no object. Reads its arguments, nothing else.

    ``request`` is vLLM's (its ids and tokens are read); ``blocks`` its blocks in the
    hidden-state cache group.
    """
    prompt = list(request.prompt_token_ids or [])
    # With output tokens: the last one was sampled, never fed back, so has no state.
    token_ids = list(request.all_token_ids)[:-1] if params.include_output_tokens else prompt
    loss_spans = None
    if params.loss_spans is not None:
        try:
            loss_spans = stored_loss_spans(params.loss_spans, len(prompt), len(token_ids))
        except ValueError as exc:  # a bug of ours: the Extractor checks spans first
            return WriteFailure(type="internal_error", message=str(exc))
        if not any(end > start for start, end in loss_spans):
            # The API let a prompt without supervised tokens through because generated
            # ones would count, but the model stopped before one had states: refuse
            # rather than store an all-zero mask.
            message = (
                "loss: no token is supervised: the prompt has none and generation "
                f"stopped after {len(request.all_token_ids) - len(prompt)} token(s), "
                "none of which has states (the last sampled token never does)"
            )
            return WriteFailure(type="invalid_request", message=message)
    layer_index = None
    if params.layers is not None:
        try:
            layer_index = layer_positions(params.layers, served.layer_ids)
        except ValueError as exc:  # a bug of ours, as above
            return WriteFailure(type="internal_error", message=str(exc))
    try:
        positions = selected_positions(params.tokens, len(prompt), len(token_ids), loss_spans)
    except ValueError as exc:
        # The API checks the selection against the prompt (and the longest generation);
        # generation that stopped early can still leave a window outside the tokens.
        return WriteFailure(type="invalid_request", message=str(exc))
    layer_ids = served.layer_ids if params.layers is None else tuple(params.layers)
    origin = served.provenance
    provenance = None if origin is None else origin.metadata(params.codec, served.dtype)
    metadata = object_metadata(served.model, layer_ids, served.dtype, params.metadata, provenance)
    if positions is not None:
        metadata[TOKENS_KEY] = selection_json(params.tokens)
    return PendingSave(
        req_id=request.request_id,
        key=params.key,
        token_ids=tuple(token_ids),
        block_ids=tuple(blocks),
        metadata=metadata,
        layer_ids=layer_ids,
        codec=params.codec,
        layer_index=None if layer_index is None else tuple(layer_index),
        loss_spans=None if loss_spans is None else tuple(loss_spans),
        positions=positions,
        pooled=is_pooled(params.tokens),
        ttl_s=params.ttl_s,
        inline_bytes=params.inline_bytes,
    )


def stored_loss_spans(
    spans: Sequence[tuple[int, int]], num_prompt: int, num_stored: int
) -> list[tuple[int, int]]:
    """The supervised ranges over the stored tokens: the prompt's ``spans``, plus the
    generated tokens that have states. Raises ValueError for spans past the prompt."""
    outside = [(start, end) for start, end in spans if end > num_prompt]
    if outside:
        raise ValueError(f"loss spans {outside[:4]} reach past the prompt's {num_prompt} tokens")
    result = [(start, end) for start, end in spans]
    if num_stored > num_prompt:
        result.append((num_prompt, num_stored))
    return result


def layer_positions(layers: Sequence[int], served: Sequence[int]) -> list[int] | None:
    """Positions of ``layers`` among the ``served`` layer ids (None: all of them).

    Raises ValueError for an id that is not served.
    """
    if list(layers) == list(served):
        return None
    unknown = [i for i in layers if i not in served]
    if unknown:
        raise ValueError(f"layers {unknown} are not served (served: {list(served)})")
    return [list(served).index(i) for i in layers]
