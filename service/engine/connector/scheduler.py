"""The connector's scheduler half (EngineCore process): which blocks to hold and save."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from service.engine.connector.common import HsxConnectorMetadata, PendingSave
from service.engine.objects import object_metadata
from service.engine.wire import REQUEST_ARG, RequestParams

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class HsxConnectorScheduler:
    """Holds each finished hsx request's blocks and queues its save for the workers."""

    def __init__(self, group: int, model_name: str, layer_ids: Sequence[int], dtype: str) -> None:
        self._group = group
        self._layer_ids = list(layer_ids)
        self._base_metadata = object_metadata(model_name, layer_ids, dtype)
        self._ready: list[PendingSave] = []
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
        self._ready.append(self._save(request, extra_args, list(blocks)))
        self._held.add(request.request_id)
        return True, None

    def _save(self, request: Request, extra_args: dict[str, Any], blocks: list[int]) -> PendingSave:
        try:
            params = RequestParams.from_extra_args(extra_args)
        except ValidationError as exc:
            # Only our Extractor sets these, so this is a bug; fail the prompt, not the engine.
            log.error("malformed hsx request parameters: %s", exc)
            raw = extra_args.get(REQUEST_ARG)
            key = str(raw.get("key", "")) if isinstance(raw, dict) else ""
            return PendingSave(request.request_id, key, [], blocks, {}, failure=str(exc))
        assert params is not None
        prompt = list(request.prompt_token_ids or [])
        # With output tokens: the last one was sampled, never fed back, so has no state.
        token_ids = list(request.all_token_ids)[:-1] if params.include_output_tokens else prompt
        base = self._base_metadata  # ours first; a caller's key never overrides ours
        metadata = {**base, **{k: v for k, v in params.metadata.items() if k not in base}}
        if params.layers is not None:
            metadata["layer_ids"] = json.dumps(list(params.layers))
        save = PendingSave(request.request_id, params.key, token_ids, blocks, metadata)
        save.codec = params.codec
        if params.layers is not None:
            try:
                save.layer_index = layer_positions(params.layers, self._layer_ids)
            except ValueError as exc:  # a bug of ours: the Extractor checks layers first
                save.failure = str(exc)
        if params.loss_spans is not None:
            try:
                save.loss_spans = stored_loss_spans(params.loss_spans, len(prompt), len(token_ids))
            except ValueError as exc:  # a bug of ours, as above
                save.failure = str(exc)
            if save.loss_spans is not None and not any(e > s for s, e in save.loss_spans):
                # The API let a prompt without supervised tokens through because generated
                # ones would count, but the model stopped before one had states: refuse
                # rather than store an all-zero mask.
                save.failure = (
                    "loss: no token is supervised: the prompt has none and generation "
                    f"stopped after {len(request.all_token_ids) - len(prompt)} token(s), "
                    "none of which has states (the last sampled token never does)"
                )
                save.failure_type = "invalid_request"
        return save

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Requests the workers copied out: vLLM frees their blocks now."""
        self._held.difference_update(connector_output.finished_sending or ())

    def has_pending_block_frees(self) -> bool:
        """Held blocks come back once copied out: vLLM waits for them rather than preempt."""
        return bool(self._held)


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
