"""What a request asks the engine for, checked once: :class:`ExtractOptions` (the same
for each of its objects) and the :class:`Job` a route hands ``service.api.extraction``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.api.codec_params import check_codec_params
from service.api.loss import PromptSpans
from service.api.state import ApiState
from service.codecs import Codec
from service.engine.wire import RequestParams
from service.masks import LossMode


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
    ) -> ExtractOptions:
        """The options, once ``codec`` and ``layers`` are known to be served (ApiError
        422 naming the field otherwise)."""
        check_codec_params(state.extractor, codec, layers)
        return cls(
            max_tokens=max_tokens,
            include_output_tokens=include_output_tokens,
            metadata=dict(metadata or {}),
            loss=loss,
            codec=state.extractor.check_codec(codec),
            layers=None if layers is None else tuple(layers),
        )

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
