"""``HsxClient``: the synchronous twin of ``AsyncHsxClient``, plus object decoding.

Objects are decoded here, by ``service.codecs`` (torch, safetensors and zstandard
only), so a reader gets model-dtype states whatever codec stored them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from service.client._base import (
    BaseHsxClient,
    Call,
    ExtractOptions,
    HsxError,
    Prompt,
    encode_extract,
    finish,
)
from service.client.models import ExtractResponse, ModelList, Tokenized, Version

__all__ = ["HsxClient", "HsxError", "decode_object"]

T = TypeVar("T")


class HsxClient(BaseHsxClient):
    """A synchronous client of one hsx server; one connection pool, reused.

    Errors as :class:`~service.client.AsyncHsxClient`'s.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = 600.0,
        max_connections: int | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout=timeout, max_connections=max_connections)
        self._http = httpx.Client(transport=transport, **self._options)

    def _send(self, call: Call[T]) -> T:
        return finish(call, self._http.request(call.method, call.path, **call.kwargs))

    def extract(
        self,
        prompts: Sequence[Prompt],
        *,
        max_tokens: int = 1,
        include_output_tokens: bool = False,
        metadata: Mapping[str, str] | None = None,
        codec: str | None = None,
        layers: Sequence[int] | None = None,
        loss: str | None = None,
        tokens: str | Mapping[str, int] | None = None,
        inline: bool = False,
    ) -> ExtractResponse:
        """``POST /extract``: the answer, whose every object is durable.

        A prompt is text, a list of token ids, or an object with one of ``text``,
        ``token_ids``, ``messages``. ``codec``, ``layers`` and ``loss`` are sent only
        when given (the server's default codec, all its layers, no mask otherwise);
        so is ``tokens`` (which positions to keep; all otherwise). ``inline``: the
        objects come back in the answer, stored nowhere (``StoredObject.tensors()``
        decodes one).
        """
        options = ExtractOptions(
            max_tokens=max_tokens,
            include_output_tokens=include_output_tokens,
            metadata=dict(metadata or {}),
            loss=loss,
            codec=codec,
            layers=layers,
            tokens=tokens,
            inline=inline,
        )
        body = encode_extract(prompts, options)
        return self._send(self._extract(body, len(prompts)))

    def models(self) -> ModelList:
        """``GET /v1/models``."""
        return self._send(self._models())

    def version(self) -> Version:
        """``GET /version``."""
        return self._send(self._version())

    def tokenize(self, model: str, prompt: Mapping[str, Any]) -> Tokenized:
        """``POST /tokenize`` of a text or messages prompt (vLLM's request shape)."""
        return self._send(self._tokenize(model, prompt))

    def get_object(self, key: str, *, decode: bool = False) -> bytes:
        """The object's bytes as stored (from S3 through the presigned redirect); with
        ``decode``, as a ``raw`` object (model-dtype states), decoded here."""
        data = self._send(self._get_object(key))
        if not decode:
            return data
        from service.codecs import to_raw

        return to_raw(data)

    #: The name this method had first.
    get_bytes = get_object

    def get(self, key: str) -> dict[str, Any]:
        """The object's tensors: ``hidden_states`` in the model dtype whatever the
        codec, ``token_ids``, and ``loss_mask`` where stored (torch)."""
        return decode_object(self.get_object(key))

    def delete(self, key: str) -> None:
        """Remove the object; HsxError (404) if it is not there."""
        self._send(self._delete(key))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HsxClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def decode_object(data: bytes) -> dict[str, Any]:
    """An object's tensors, its states decoded to the model dtype (any codec)."""
    from service.codecs import decode

    tensors, _ = decode(data)
    return dict(tensors)
