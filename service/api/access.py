"""The outermost layer: one access-log line per request, and an answer for every request.

The line says method, path, status, the caller's namespace (or ``unauthenticated``) and
the duration; never a key, a header or a body. A request that uvicorn cancels (a
shutdown past its grace period) gets the documented 503 instead of uvicorn's plain-text
500 and a ``CancelledError`` traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import SCOPE_NAMESPACE
from service.api.errors import ApiError

log = logging.getLogger("hsx.access")


class AccessMiddleware:
    """Logs every HTTP request once and turns a cancelled one into a 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 0

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except asyncio.CancelledError:
            if status:  # the answer had begun: nothing better than closing
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            await shutdown_error().response()(scope, receive, recording_send)
        finally:
            self._log(scope, status, time.monotonic() - started)

    @staticmethod
    def _log(scope: Scope, status: int, elapsed: float) -> None:
        namespace = scope.get(SCOPE_NAMESPACE) or "unauthenticated"
        path = json.dumps(scope["path"][:200])  # quoted: a path cannot forge a log line
        log.info("%s %s %d %s %.3fs", scope["method"], path, status, namespace, elapsed)


def shutdown_error() -> ApiError:
    """What a request cut off by shutdown gets: its work was aborted, nothing kept."""
    return ApiError(
        503,
        "unavailable",
        "the server shut down before the request finished; its work was aborted",
        headers={"Retry-After": "5", "Connection": "close"},
    )
