"""Bounds on reading a request body: size (413), time (408), and bytes read at once (429).

Runs after the key check (``service.api.auth``), so only an authenticated caller's body
is ever read. A declared ``Content-Length`` over the limit is refused before a byte is
read; a chunked body is counted as it arrives and refused the moment it passes the
limit, so a client cannot make the server buffer more than the limit. The whole body
must arrive within ``body_timeout_s`` of the first read. Before reading, a body reserves
its declared size (a chunked one: the limit) from a budget shared by all requests; when
the budget is spent, the request gets 429 instead of more memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import ApiError, BodyError

__all__ = ["BodyBudget", "BodyError", "BodyLimitMiddleware"]


@dataclass
class BodyBudget:
    """Bytes of request bodies being read, over all requests (event loop only: no lock)."""

    limit: int
    used: int = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


class BodyLimitMiddleware:
    """ASGI middleware enforcing ``max_bytes``, ``timeout_s`` and the shared ``budget``."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, budget: BodyBudget) -> None:
        self.app, self.max_bytes, self.timeout_s, self.budget = app, max_bytes, timeout_s, budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self.too_large().response()(scope, receive, send)
            return
        reading = _BodyReader(self, receive, self.max_bytes if declared is None else declared)
        try:
            await self.app(scope, reading.receive, send)
        finally:
            reading.release()

    def too_large(self) -> ApiError:
        return ApiError(
            413,
            "payload_too_large",
            f"body: request body is larger than {self.max_bytes} bytes",
            field="body",
        )


class _BodyReader:
    """One request's ``receive``: reserves from the budget, counts, keeps the deadline."""

    def __init__(self, limits: BodyLimitMiddleware, receive: Receive, reserve: int) -> None:
        self.limits, self._receive, self.reserve = limits, receive, reserve
        self.seen = 0
        self.held = 0
        self.done = False
        self.deadline: float | None = None

    async def receive(self) -> Message:
        if self.done:  # after the body: only http.disconnect comes, whenever it comes
            return await self._receive()
        loop = asyncio.get_running_loop()
        if self.deadline is None:
            if not self.limits.budget.take(self.reserve):
                raise BodyError(
                    ApiError(
                        429,
                        "overloaded",
                        "body: too many request bodies are being read; retry later",
                        field="body",
                        headers={"Retry-After": "1"},
                    )
                )
            self.held = self.reserve
            self.deadline = loop.time() + self.limits.timeout_s
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            raise BodyError(
                ApiError(
                    408,
                    "request_timeout",
                    f"body: not received within {self.limits.timeout_s:g} s",
                    field="body",
                    headers={"Connection": "close"},
                )
            ) from None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limits.max_bytes:
                raise BodyError(self.limits.too_large())
            if not message.get("more_body", False):
                self.done = True
                self.release()
        else:
            self.done = True
        return message

    def release(self) -> None:
        if self.held:
            self.limits.budget.give(self.held)
            self.held = 0


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
