"""Bounds on every HTTP connection, enforced below the ASGI app, before any routing.

What uvicorn (0.54) gives and what it does not, and so who enforces each bound:

- **Keep-alive timeout**: uvicorn's ``timeout_keep_alive`` (idle time after a response).
- **Connection cap**: uvicorn's ``limit_concurrency`` does not suffice: past it uvicorn
  still accepts and keeps every connection and only answers each *request* with a
  plain-text 503. Here a connection past ``max_connections`` gets our 503 and is closed
  at once, before a byte of it is parsed.
- **Header size (431)**: uvicorn's default parser, httptools (llhttp), has no limit on
  the request head: Node enforces its own outside llhttp, and uvicorn adds none, so a
  128 MiB header was read (and re-concatenated by httptools) in full. uvicorn's h11
  protocol has one (``h11_max_incomplete_event_size``) but answers 400 and parses every
  byte in pure Python. We keep httptools and count the head's bytes as they arrive.
- **Header read timeout**: uvicorn has none, and nothing at all for a connection that
  never sends a byte (its keep-alive timer starts only after a first response). Here a
  timer runs from the connection's start, or from a request's first byte, until its
  headers are complete.
- **Body read timeout and the bytes of bodies being read**: in the ASGI layer
  (``service.api.body_limit``), where a body is read only once the key was checked.
- **An unread body after an early answer** (401, 413): uvicorn keeps reading and
  discarding it for as long as the client sends. Here that discarding is bounded by the
  header timeout and by ``max_body_bytes``; past either the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.config import Settings

access_log = logging.getLogger("hsx.access")


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized head."""


@dataclass(frozen=True)
class ConnectionLimits:
    """The per-connection bounds the protocol enforces."""

    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    max_discard_bytes: int


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a connection cap, a head size limit and timers.

    ``limits`` is set on a subclass made by :func:`protocol_for`.
    """

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True
        self._head_bytes = 0
        self._discarded = 0
        self._oversized = False
        self._timer: asyncio.TimerHandle | None = None

    # -- connection ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "unavailable", "too many open connections; retry later")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if (
            self._reading_head
            and self._head_bytes > self.limits.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._refuse_head()

    # -- parser callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_head = True
        if self._timer is None:  # a request's first byte after keep-alive idling
            self._arm()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        self._disarm()
        # A head that arrived whole in one read was not counted above: measure it.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._oversized = True
            raise _HeadTooLarge  # stops the parser; uvicorn then calls send_400_response
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._oversized:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None and self.cycle.response_complete:
            self._discarded += len(body)  # answered already (401, 413): dropped unread
            if self._discarded > self.limits.max_discard_bytes:
                self.transport.close()
                return
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes = 0
        self._discarded = 0
        if self.cycle is not None and self.cycle.response_complete:
            self._disarm()  # the discarded body ended: idle, as after any response
            self._timer = self.loop.call_later(self.timeout_keep_alive, self._close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            # Answered before the body was read: discard the rest, for a bounded time.
            self._unset_keepalive_if_required()
            self._arm()

    # -- helpers --------------------------------------------------------------------

    def _refuse_head(self) -> None:
        self._refuse(
            431,
            "headers_too_large",
            f"headers: the request head is larger than {self.limits.max_header_bytes} bytes",
            field="headers",
        )

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._reading_head and self._head_bytes:
            self._refuse(
                408,
                "request_timeout",
                f"headers: not complete within {self.limits.header_timeout_s:g} s",
                field="headers",
            )
        else:  # never sent a byte, or a discarded body took too long
            self.transport.close()

    def _close(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, kind: str, message: str, *, field: str | None = None) -> None:
        """Answer in the shared error shape and close; nothing more is read."""
        self._disarm()
        detail: dict[str, Any] = {"type": kind, "message": message}
        if field is not None:
            detail["field"] = field
        body = json.dumps({"error": detail}).encode()
        phrase = {408: "Request Timeout", 431: "Request Header Fields Too Large"}.get(
            status, "Service Unavailable"
        )
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()
        # The access-log line the app would have written (method and path may be unread).
        access_log.info('- "-" %d unauthenticated 0.000s', status)


def protocol_for(settings: Settings) -> type[BoundedHttpProtocol]:
    """A protocol class carrying ``settings``' connection bounds, for ``uvicorn.Config(http=)``."""
    server = settings.server
    limits = ConnectionLimits(
        max_connections=server.max_connections,
        max_header_bytes=server.max_header_bytes,
        header_timeout_s=server.header_timeout_s,
        max_discard_bytes=settings.limits.max_body_bytes,
    )
    return type("HsxHttpProtocol", (BoundedHttpProtocol,), {"limits": limits})


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for the bounds above (host and port aside)."""
    return {
        "http": protocol_for(settings),
        "timeout_keep_alive": settings.server.keep_alive_timeout_s,
        "timeout_graceful_shutdown": max(1, round(settings.server.shutdown_grace_s)),
        "server_header": False,  # no "server: uvicorn": versions and products stay private
        "access_log": False,  # hsx writes its own, one line per request (service.api.access)
        # Concurrency is bounded per connection above and per prompt by admission.
        "limit_concurrency": None,
    }
