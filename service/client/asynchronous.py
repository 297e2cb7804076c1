"""``AsyncHsxClient``: hsx's HTTP API on asyncio, with typed answers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from service.client._base import (
    BaseHsxClient,
    Call,
    ExtractOptions,
    Prompt,
    encode_extract,
    finish,
)
from service.client.models import ExtractResponse, ModelList, Tokenized, Version

T = TypeVar("T")


class AsyncHsxClient(BaseHsxClient):
    """An asyncio client of one hsx server; one connection pool, reused.

    Every error answer raises :class:`~service.client.HsxError`, a success whose body is
    not hsx's answer :class:`~service.client.BadResponseError`; a connection that fails
    raises httpx's ``TransportError`` as it is.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = 600.0,
        max_connections: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout=timeout, max_connections=max_connections)
        self._http = httpx.AsyncClient(transport=transport, **self._options)

    async def _send(self, call: Call[T]) -> T:
        response = await self._http.request(call.method, call.path, **call.kwargs)
        return finish(call, response)

    async def extract(
        self, prompts: Sequence[Prompt], options: ExtractOptions | None = None
    ) -> ExtractResponse:
        """``POST /extract``: every object of the answer is durable."""
        body = encode_extract(prompts, options or ExtractOptions())
        return await self.extract_encoded(body, len(prompts))

    async def extract_encoded(self, body: bytes, count: int) -> ExtractResponse:
        """``POST /extract`` with a body made by ``encode_extract`` for ``count`` prompts
        (a caller that must know which prompt cannot be encoded encodes first)."""
        return await self._send(self._extract(body, count))

    async def models(self) -> ModelList:
        """``GET /v1/models``: the served model and what its objects hold."""
        return await self._send(self._models())

    async def version(self) -> Version:
        """``GET /version``."""
        return await self._send(self._version())

    async def tokenize(self, model: str, prompt: Mapping[str, Any]) -> Tokenized:
        """``POST /tokenize`` of a text or messages prompt (vLLM's request shape)."""
        return await self._send(self._tokenize(model, prompt))

    async def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text."""
        return await self._send(self._metrics())

    async def get_object(self, key: str, *, decode: bool = False) -> bytes:
        """The object's bytes as stored (following S3's presigned redirect); with
        ``decode``, as a ``raw`` object (model-dtype states), decoded here off the loop."""
        data = await self._send(self._get_object(key))
        if not decode:
            return data
        from service.codecs import to_raw

        return await asyncio.to_thread(to_raw, data)

    async def delete(self, key: str) -> None:
        """Remove the object; HsxError (404) if it is not there."""
        await self._send(self._delete(key))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncHsxClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
