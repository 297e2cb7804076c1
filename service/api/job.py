"""What a request asks the engine for, checked once: :class:`ExtractOptions` (the same
for each of its objects) and the :class:`Job` a route hands ``service.api.extraction``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service import codecs
from service.api.codec_params import check_codec_params
from service.api.errors import ApiError
from service.api.loss import PromptSpans
from service.api.state import ApiState
from service.codecs import Codec
from service.engine.wire import RequestParams, TokenSelection, is_pooled, selected_positions
from service.masks import LossMode
from service.storage.expiry import MAX_TTL_S


@dataclass(frozen=True)
class ExtractOptions:
    """What a request asks of each of its objects (``wire.RequestParams`` but the key
    and the prompt's own loss spans), checked against this server once per request."""

    max_tokens: int
    include_output_tokens: bool
    metadata: Mapping[str, str]
    #: How the loss spans were asked for (recorded on objects under a custom_id).
    loss: LossMode
    #: The codec resolved: the request's, or the server's default.
    codec: Codec
    layers: tuple[int, ...] | None
    #: Which stored token positions each object keeps (``wire.RequestParams.tokens``).
    tokens: TokenSelection = "all"
    #: Seconds each object lives: the request's, or the server's default (None: forever).
    ttl_s: int | None = None
    #: ``return: inline``: the request's objects together may take this many bytes
    #: (``limits.max_inline_bytes``); None: written to storage.
    inline_bytes: int | None = None

    @classmethod
    def checked(
        cls,
        state: ApiState,
        *,
        max_tokens: int,
        include_output_tokens: bool,
        metadata: Mapping[str, str] | None,
        loss: LossMode,
        codec: str | None,
        layers: Sequence[int] | None,
        tokens: TokenSelection = "all",
        ttl_s: int | None = None,
        inline: bool = False,
    ) -> ExtractOptions:
        """The options, once ``codec`` and ``layers`` are known to be served and
        ``tokens`` to fit ``loss`` (ApiError 422 naming the field otherwise)."""
        check_codec_params(state.extractor, codec, layers)
        if tokens == "mean_loss" and loss == "none":
            raise ApiError(
                422,
                "invalid_request",
                "tokens: 'mean_loss' averages over the loss mask: set loss too",
                field="tokens",
            )
        if ttl_s is not None and not 1 <= ttl_s <= MAX_TTL_S:
            raise ApiError(
                422, "invalid_request", f"ttl_s: must be 1 to {MAX_TTL_S} seconds", field="ttl_s"
            )
        if ttl_s is not None and not inline and not state.storage.expires:
            raise ApiError(
                422,
                "invalid_request",
                f"ttl_s: {state.storage.scheme}:// storage cannot expire objects; the "
                "reader deletes what it read",
                field="ttl_s",
            )
        return cls(
            max_tokens=max_tokens,
            include_output_tokens=include_output_tokens,
            metadata=dict(metadata or {}),
            loss=loss,
            codec=state.extractor.check_codec(codec),
            layers=None if layers is None else tuple(layers),
            tokens=tokens,
            ttl_s=ttl_s if ttl_s is not None else state.settings.storage.default_ttl_s,
            inline_bytes=state.settings.limits.max_inline_bytes if inline else None,
        )

    def check_prompts(
        self,
        state: ApiState,
        token_ids: Sequence[list[int]],
        spans: Sequence[PromptSpans],
        custom_ids: Sequence[str | None],
    ) -> None:
        """Once the prompts' lengths are known, before the engine runs: ApiError 422
        naming ``tokens`` (and the prompt's index) for a selection that keeps nothing,
        or naming ``return`` for an inline answer over its limit or under a
        ``custom_id`` (which finds a stored object again: an inline one never is).

        A prompt stores its own tokens, plus up to ``max_tokens - 1`` generated ones
        with ``include_output_tokens``: both are checked against the longest sequence
        the prompt can store (the worker checks the real one again).
        """
        rows = [
            self._stored_rows(i, ids, s)
            for i, (ids, s) in enumerate(zip(token_ids, spans, strict=True))
        ]
        if self.inline_bytes is None:
            return
        if any(custom_id is not None for custom_id in custom_ids):
            message = "return: an inline answer is stored nowhere, so it takes no custom_id"
            raise ApiError(422, "invalid_request", message, field="return")
        self._check_inline(state, rows)

    def _stored_rows(self, index: int, ids: Sequence[int], spans: PromptSpans) -> int:
        """The most ``hidden_states`` rows prompt ``index`` can store; ApiError 422 naming
        ``tokens`` when its selection keeps none."""
        num_prompt = len(ids)
        num_stored = num_prompt + (self.max_tokens - 1 if self.include_output_tokens else 0)
        stored_spans = None
        if spans is not None:
            generated = [(num_prompt, num_stored)] if num_stored > num_prompt else []
            stored_spans = [*spans, *generated]
        try:
            positions = selected_positions(self.tokens, num_prompt, num_stored, stored_spans)
        except ValueError as exc:
            raise ApiError(422, "invalid_request", str(exc), field="tokens", index=index) from None
        if positions is None:
            return num_stored
        return 1 if is_pooled(self.tokens) else len(positions)

    def _check_inline(self, state: ApiState, rows: Sequence[int]) -> None:
        """ApiError 422 naming ``return`` when the objects' states, ``rows`` of each
        prompt in this codec, are over the inline limit (``lossless`` counted at its
        uncompressed size: what it compresses to is known only once encoded)."""
        import torch

        extractor, limit = state.extractor, self.inline_bytes
        assert limit is not None
        layers = len(extractor.layer_ids if self.layers is None else self.layers)
        dtype = getattr(torch, extractor.dtype)
        shape = (sum(rows), layers, extractor.info.hidden_size)
        size = codecs.prepared_nbytes(self.codec, shape, dtype)
        if size > limit:
            message = (
                f"return: inline states of {size} bytes ({shape[0]} token rows x {layers} "
                f"layers x {shape[2]}) are over limits.max_inline_bytes ({limit}); ask for "
                "return 'storage', fewer tokens (tokens) or layers, or a smaller codec"
            )
            raise ApiError(422, "invalid_request", message, field="return")

    def params(
        self, key: str, spans: PromptSpans, metadata: Mapping[str, str] | None = None
    ) -> RequestParams:
        """One prompt's engine parameters: these options under ``key`` with its loss
        ``spans``; ``metadata`` replaces the request's (``service.api.idempotency``)."""
        return RequestParams(
            key=key,
            include_output_tokens=self.include_output_tokens,
            metadata=dict(self.metadata if metadata is None else metadata),
            loss_spans=None if spans is None else tuple(spans),
            codec=self.codec,
            layers=self.layers,
            tokens=self.tokens,
            ttl_s=self.ttl_s,
            inline_bytes=self.inline_bytes,
        )


@dataclass(frozen=True)
class Job:
    """One request's prompts, ready for the engine: checked and tokenised."""

    namespace: str
    token_ids: Sequence[list[int]]
    #: Each prompt's supervised ranges (None: no mask).
    spans: Sequence[PromptSpans]
    #: Each prompt's custom_id (None: a fresh object under a random key).
    custom_ids: Sequence[str | None]
    options: ExtractOptions
    #: When the request is given up (``time.monotonic``; ``prompts.request_deadline``).
    deadline: float
