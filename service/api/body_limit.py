"""Refuse bodies over the limit while reading them, before any parsing (413).

A declared ``Content-Length`` over the limit is refused before a byte is read; a
chunked body is counted as it arrives and refused the moment it passes the limit, so
a client cannot make the server buffer more than the limit.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import ApiError


class BodyTooLarge(HTTPException):
    """An HTTPException so FastAPI re-raises it while parsing instead of making it a 400."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"body: request body is larger than {max_bytes} bytes")


class BodyLimitMiddleware:
    """ASGI middleware answering 413 for a request body over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(
            413,
            "payload_too_large",
            f"body: request body is larger than {self.max_bytes} bytes",
            field="body",
        )
        await error.response()(scope, receive, send)
