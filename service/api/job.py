"""What a request asks the engine for, checked once: :class:`ExtractOptions` (the same
for each of its objects) and the :class:`Job` a route hands ``service.api.extraction``.

An inline answer (``return: inline``) is sized here before the engine runs: every
tensor of each object and its header (the request's metadata included, JSON-escaped as
the writer escapes it), at the longest generation. The request is refused past
``limits.max_inline_bytes``; otherwise each object gets a share of the limit, the
shares summing to at most the limit, and the worker fails an object over its share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service import codecs
from service.api.codec_params import check_codec_params
from service.api.errors import ApiError
from service.api.loss import PromptSpans
from service.api.state import ApiState
from service.codecs import CODEC_KEY, CODEC_VERSION, CODEC_VERSION_KEY, TOKENS_KEY, Codec
from service.engine.objects import object_metadata
from service.engine.wire import (
    RequestParams,
    TokenSelection,
    is_pooled,
    selected_positions,
    selection_json,
)
from service.masks import LossMode
from service.storage.expiry import MAX_TTL_S

#: Header bytes besides the metadata: at most six tensor entries (name, dtype, shape,
#: offsets: well under 160 bytes each), the 8-byte length and the padding to 8 bytes.
_TENSOR_ENTRIES_BYTES = 1024
#: int64 ``token_ids`` and ``positions``: bytes per entry.
_INDEX_BYTES = 8


@dataclass(frozen=True)
class _Stored:
    """The most one prompt's object can hold (at its longest generation)."""

    #: Entries of ``token_ids`` (and of ``loss_mask``, with a mask).
    tokens: int
    #: Rows of ``hidden_states``.
    rows: int
    #: Entries of ``positions`` (0: ``tokens: all`` stores none).
    positions: int
    masked: bool


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
    ) -> tuple[int, ...] | None:
        """Once the prompts' lengths are known, before the engine runs: ApiError 422
        naming ``tokens`` (and the prompt's index) for a selection that keeps nothing,
        or naming ``return`` for an inline answer over its limit or under a
        ``custom_id`` (which finds a stored object again: an inline one never is).

        Returns each object's share of the inline limit (what :class:`Job` takes), or
        None for objects written to storage.

        A prompt stores its own tokens, plus up to ``max_tokens - 1`` generated ones
        with ``include_output_tokens``: both are checked against the longest sequence
        the prompt can store (the worker checks the real one again).
        """
        stored = [
            self._stored(i, ids, s) for i, (ids, s) in enumerate(zip(token_ids, spans, strict=True))
        ]
        if self.inline_bytes is None:
            return None
        if any(custom_id is not None for custom_id in custom_ids):
            message = "return: an inline answer is stored nowhere, so it takes no custom_id"
            raise ApiError(422, "invalid_request", message, field="return")
        return self._inline_shares(state, stored)

    def _stored(self, index: int, ids: Sequence[int], spans: PromptSpans) -> _Stored:
        """The most prompt ``index``'s object can hold; ApiError 422 naming ``tokens``
        when its selection keeps no token."""
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
        masked = spans is not None
        if positions is None:
            return _Stored(tokens=num_stored, rows=num_stored, positions=0, masked=masked)
        rows = 1 if is_pooled(self.tokens) else len(positions)
        return _Stored(tokens=num_stored, rows=rows, positions=len(positions), masked=masked)

    def _inline_shares(self, state: ApiState, stored: Sequence[_Stored]) -> tuple[int, ...]:
        """Each object's share of the inline limit, in proportion to its size (so each
        share holds its object, and the shares sum to at most the limit); ApiError 422
        naming ``return`` when the objects together are over the limit."""
        limit = self.inline_bytes
        assert limit is not None
        header = self._header_bytes(state)
        sizes = [self._object_bytes(state, s) + header for s in stored]
        total = sum(sizes)
        if total > limit:
            rows, tokens = sum(s.rows for s in stored), sum(s.tokens for s in stored)
            message = (
                f"return: {len(stored)} inline objects take up to {total} bytes ({rows} "
                f"hidden-state rows, {tokens} token ids, and a {header}-byte header each, "
                f"the metadata included), over limits.max_inline_bytes ({limit}); ask for "
                "return 'storage', fewer or shorter prompts, fewer tokens (tokens) or "
                "layers, less metadata, or a smaller codec"
            )
            raise ApiError(422, "invalid_request", message, field="return")
        return tuple(limit * size // total for size in sizes)

    def _object_bytes(self, state: ApiState, stored: _Stored) -> int:
        """The most bytes one object's tensors take: ``hidden_states`` in this codec
        (``lossless`` at its uncompressed size plus zstd's worst-case growth: what it
        compresses to is known only once encoded), int64 ``token_ids`` and
        ``positions``, uint8 ``loss_mask``."""
        import torch

        extractor = state.extractor
        layers = len(extractor.layer_ids if self.layers is None else self.layers)
        shape = (stored.rows, layers, extractor.info.hidden_size)
        states = codecs.prepared_nbytes(self.codec, shape, getattr(torch, extractor.dtype))
        if self.codec == "lossless":  # ZSTD_compressBound: input + input/256 + a frame
            states += states // 256 + 1024
        indices = _INDEX_BYTES * (stored.tokens + stored.positions)
        return states + indices + (stored.tokens if stored.masked else 0)

    def _header_bytes(self, state: ApiState) -> int:
        """The most bytes of one object's safetensors header: its ``__metadata__`` as
        the writer makes it (the scheduler's keys and ``codecs.safetensors_parts``'s
        JSON, where a control character in a caller's value takes 6 bytes) and the
        tensor entries."""
        extractor = state.extractor
        layer_ids = extractor.layer_ids if self.layers is None else self.layers
        provenance = extractor.provenance.metadata(self.codec, extractor.dtype)
        meta = object_metadata(
            extractor.info.name, layer_ids, extractor.dtype, self.metadata, provenance
        )
        meta |= {
            CODEC_KEY: self.codec,
            CODEC_VERSION_KEY: CODEC_VERSION,
            TOKENS_KEY: selection_json(self.tokens),
        }
        text = json.dumps({"__metadata__": meta}, separators=(",", ":"), ensure_ascii=False)
        return len(text.encode()) + _TENSOR_ENTRIES_BYTES

    def params(
        self,
        key: str,
        spans: PromptSpans,
        metadata: Mapping[str, str] | None = None,
        *,
        inline_bytes: int | None = None,
    ) -> RequestParams:
        """One prompt's engine parameters: these options under ``key`` with its loss
        ``spans``; ``metadata`` replaces the request's (``service.api.idempotency``).

        ``inline_bytes``: the object's share of the inline limit (``check_prompts``),
        required for an inline request (ValueError otherwise): the whole limit would
        let every object take it.
        """
        if (inline_bytes is None) != (self.inline_bytes is None):
            raise ValueError("an inline object needs its share of the limit, and only it")
        return RequestParams(
            key=key,
            include_output_tokens=self.include_output_tokens,
            metadata=dict(self.metadata if metadata is None else metadata),
            loss_spans=None if spans is None else tuple(spans),
            codec=self.codec,
            layers=self.layers,
            tokens=self.tokens,
            ttl_s=self.ttl_s,
            inline_bytes=inline_bytes,
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
    #: ``return: inline``: each object's share of the limit (``check_prompts``' answer);
    #: None: written to storage.
    inline_shares: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if (self.inline_shares is None) != (self.options.inline_bytes is None):
            raise ValueError("an inline job needs each object's share (check_prompts)")

    def params(self, index: int, key: str) -> RequestParams:
        """Prompt ``index``'s engine parameters, its object under ``key``."""
        shares = self.inline_shares
        inline_bytes = None if shares is None else shares[index]
        return self.options.params(key, self.spans[index], inline_bytes=inline_bytes)
