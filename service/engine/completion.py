"""The channel that tells the API process an object is durable (or failed).

We use a ZeroMQ PUSH/PULL pair over an IPC socket rather than vLLM's KV-connector stats
path: stats are aggregated and delivered on the logging interval (seconds, batched,
meant for metrics), while a request waits on its own completion and needs it at once,
carrying an error message. pyzmq ships with vLLM, and vLLM itself talks between its
processes this way. The worker (tensor-parallel rank 0) PUSHes one message per object;
the API process binds the PULL end before the engine starts and resolves one future per
object key. Keys are unique and made by the server, so they are the correlation id.
Messages are :class:`service.engine.wire.Completion` (JSON, validated on receipt); they
also carry the worker's storage calls for ``/metrics`` (why there: ``service.engine.metrics``).

The socket is ``ipc://`` by default (the writing rank on the API's host: TP within a
node), or ``tcp://`` (``engine.completion_address``) where the writing rank can run on
another node. Either way the writer's first message is a ``WriterHello``, and start-up
waits for it: a writer that cannot reach the API stops the server with one line
instead of leaving every request to hang until its deadline.

The API trusts what arrives here (it answers ``created`` with the key a message names),
so the channel is authenticated and bounded, whatever its transport:

* every message is two frames, an HMAC-SHA256 of the payload under a secret the API
  makes at each start and hands to the engine in the connector's config, then the
  payload. A message whose tag does not verify is dropped and counted before it is
  parsed (``hsx_completion_messages_dropped_total{reason}``), never logged whole;
* ``ZMQ_MAXMSGSIZE`` is the largest legitimate message (an inline object in base64 and
  its record): ZeroMQ drops a peer that sends more before it is buffered;
* a ``tcp://`` channel binds the address's own host (``engine.completion_bind`` to
  choose another), never every interface by default;
* the loop yields to the event loop every ``MESSAGES_PER_TURN`` messages, so a flood
  cannot starve the HTTP routes; drop warnings are rate-limited, keys truncated.

Why an HMAC rather than ZeroMQ's CURVE: the same code protects ``ipc://`` and
``tcp://``, it needs no authenticator thread, and pyzmq's CURVE depends on how libzmq
was built. What it does not give is secrecy: on ``tcp://`` a completion's record (and an
inline object's bytes) cross the network in the clear, so the channel belongs on the
cluster's private network, as vLLM's own ZeroMQ sockets do. A replayed message is
harmless: a key's waiter takes one completion, a second one finds no waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
from pydantic import TypeAdapter

from service.config import split_tcp
from service.engine.errors import CompletionChannelError
from service.engine.metrics import DROP_REASONS
from service.engine.wire import ChannelMessage, Completion, WriterHello

log = logging.getLogger(__name__)

__all__ = [
    "DROP_REASONS",
    "Completion",
    "CompletionReceiver",
    "CompletionSender",
    "max_message_bytes",
    "new_secret",
]

#: How long closing waits for one more completion before it takes the queue as empty.
DRAIN_WAIT_MS = 100
#: Messages handled before the loop yields: zmq.asyncio hands over a message that is
#: already queued without a trip through the event loop, so a flood would otherwise
#: hold the loop (and every HTTP route) for as long as it lasts.
MESSAGES_PER_TURN = 64
#: Room for a completion's record beside an inline object's bytes: statistics per
#: layer, the storage calls since the last message, the manifest of a packed object.
MESSAGE_OVERHEAD_BYTES = 4 << 20
#: At most one warning about dropped messages per this many seconds.
DROP_WARNING_INTERVAL_S = 10.0
#: Characters of a dropped message's key a warning shows.
KEY_SHOWN = 120
_MESSAGES: TypeAdapter[ChannelMessage] = TypeAdapter(ChannelMessage)


def new_secret() -> str:
    """A fresh channel secret (hex), made by the API at each start."""
    return secrets.token_hex(32)


def max_message_bytes(max_inline_bytes: int) -> int:
    """The largest legitimate message: an inline object of ``max_inline_bytes`` in base64
    plus its record."""
    return -(-max_inline_bytes // 3) * 4 + MESSAGE_OVERHEAD_BYTES


def _tag(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


class CompletionSender:
    """Worker side: PUSH completions (one socket, used from one thread), each tagged
    with the channel's secret."""

    def __init__(self, address: str, secret: str) -> None:
        self._key = bytes.fromhex(secret)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 5000)  # flush on close, but never hang forever
        if _is_ipv6_host(address):
            self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.connect(address)

    def _send(self, payload: bytes) -> None:
        self._socket.send_multipart((_tag(self._key, payload), payload), copy=False)

    def send(self, completion: Completion) -> None:
        """Queue one message (ZeroMQ sends it on its own I/O thread)."""
        self._send(completion.encode())

    def hello(self) -> None:
        """Tell the API this writer reaches it (sent once, before any completion)."""
        hello = WriterHello(writer_pid=os.getpid(), host=socket.gethostname())
        self._send(hello.model_dump_json().encode())

    def close(self) -> None:
        """Close, flushing queued messages for up to the linger time."""
        self._socket.close()
        self._context.term()


def _is_ipv6_host(address: str) -> bool:
    if not address.startswith("tcp://"):
        return False
    try:
        return ipaddress.ip_address(split_tcp(address)[0]).version == 6
    except ValueError:
        return False


def bind_host(host: str) -> str:
    """The interface address to bind for ``host`` (an IP address, or a name resolved to
    its first address). ValueError when the name does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"cannot resolve {host!r} to an address to listen on: {exc}") from None
    return str(infos[0][4][0])


class CompletionReceiver:
    """API side: PULL completions and resolve the future waiting on each key.

    ``expect`` is called before the request is submitted, so a completion never
    precedes its waiter. One for a key nobody waits on any more (the request was
    cancelled) goes to ``on_orphan``. A completion that resolves a waiter or an
    abandoned key is first shown to ``on_message`` (metrics); one for a key nobody asked
    for is dropped unseen, so no message can add a series to ``/metrics``.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | None = None,
        bind: str = "",
        max_message_bytes: int = MESSAGE_OVERHEAD_BYTES,
    ) -> None:
        """Listen on ``address``: ``ipc://PATH``, or ``tcp://HOST:PORT`` (bound on HOST,
        or on ``bind`` when given; ``address`` then names the port the writer connects
        to, a free one for PORT 0). ``secret`` (hex; a fresh one when None) is what a
        sender must tag its messages with: hand :attr:`secret` to the writer."""
        self.secret = secret if secret is not None else new_secret()
        self._key = bytes.fromhex(self.secret)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if address.startswith("tcp://"):
            host, port = split_tcp(address)
            interface = bind_host(bind or host)
            if ipaddress.ip_address(interface).version == 6:
                self._socket.setsockopt(zmq.IPV6, 1)
                interface = f"[{interface}]"
            endpoint = f"tcp://{interface}:{port or '*'}"
            try:
                self._socket.bind(endpoint)
            except zmq.ZMQError as exc:
                self._socket.close()
                self._context.term()
                raise CompletionChannelError(f"cannot listen on {endpoint}: {exc}") from None
            bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            shown = f"[{host}]" if ":" in host else host  # an IPv6 literal
            address = f"tcp://{shown}:{bound.rsplit(':', 1)[1]}"
        else:
            self._socket.bind(address)
        self.address = address
        #: Set once every writing rank's hello has arrived (``WriterHello``; one writer
        #: per data-parallel engine: ``writers``).
        self.writer_ready = asyncio.Event()
        self.writers = 1
        self._hellos = 0
        self._waiting: dict[str, asyncio.Future[Completion]] = {}
        self._abandoned: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._orphans: set[asyncio.Task[Any]] = set()  # held: the loop keeps weak refs only
        #: Called with the completion of an abandoned key (e.g. to delete its object).
        self.on_orphan: Callable[[Completion], Coroutine[Any, Any, None]] | None = None
        #: Called with every completion that resolves a waiter or an abandoned key.
        self.on_message: Callable[[Completion], None] | None = None
        #: Called with the reason (one of ``DROP_REASONS``) of every dropped message.
        self.on_drop: Callable[[str], None] | None = None
        #: Messages dropped, by reason, since start.
        self.dropped: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        self._last_warning = 0.0

    def start(self) -> None:
        """Start receiving on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="hsx-completions")

    def expect(self, key: str) -> asyncio.Future[Completion]:
        """A future that resolves with ``key``'s completion."""
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        # An idempotent key asked for again after its earlier request was abandoned (a
        # client killed, then its retry): the new waiter takes the next completion under
        # the key, which is the same prompt's object either way. Left in _abandoned, that
        # completion went to on_orphan and the retry waited forever.
        self._abandoned.discard(key)
        return future

    def abandon(self, key: str, waiter: asyncio.Future[Completion] | None = None) -> None:
        """Nobody waits for ``key`` any more; its completion goes to ``on_orphan``.

        ``waiter`` is the future ``expect`` gave: its completion may already have been
        delivered (the caller was cancelled before it resumed) and must not be lost.
        """
        future = self._waiting.pop(key, None) or waiter
        if future is not None and future.done() and not future.cancelled():
            self._dispatch_orphan(future.result())
            return
        if future is not None:
            future.cancel()
        self._abandoned.add(key)

    def _dispatch_orphan(self, completion: Completion) -> None:
        if self.on_orphan is not None:
            task = asyncio.get_running_loop().create_task(self.on_orphan(completion))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)

    async def _loop(self) -> None:
        while True:
            for _ in range(MESSAGES_PER_TURN):
                self._handle(await self._socket.recv_multipart(copy=False))
            await asyncio.sleep(0)  # let the HTTP routes run between bursts

    def _handle(self, frames: list[Any]) -> None:
        payload = self._verified(frames)
        if payload is None:
            self._drop("unauthenticated", None)
            return
        try:
            message = _MESSAGES.validate_json(payload)
        except ValueError:  # pydantic's ValidationError is one; authentic but unreadable
            self._drop("malformed", None)
            return
        if isinstance(message, WriterHello):
            log.info("hsx: writer pid %d on %s reached the API", message.writer_pid, message.host)
            self._hellos += 1
            if self._hellos >= self.writers:
                self.writer_ready.set()
            return
        self._deliver(message)

    def _verified(self, frames: list[Any]) -> bytes | None:
        """The payload of a message whose tag verifies; None for any other."""
        if len(frames) != 2:
            return None
        tag, payload = frames[0].bytes, frames[1].bytes
        return payload if hmac.compare_digest(tag, _tag(self._key, payload)) else None

    def _observe(self, completion: Completion) -> None:
        if self.on_message is not None:
            try:
                self.on_message(completion)
            except Exception:  # metrics must never stop delivery
                log.exception("completion observer failed")

    def _deliver(self, completion: Completion) -> None:
        key = completion.key
        if key in self._abandoned:
            self._abandoned.discard(key)
            self._observe(completion)
            self._dispatch_orphan(completion)
            return
        future = self._waiting.pop(key, None)
        if future is None:
            self._drop("unknown_key", key)
            return
        self._observe(completion)
        if not future.done():
            future.set_result(completion)

    def _drop(self, reason: str, key: str | None) -> None:
        """Count a dropped message; warn at most once per interval, with the counts."""
        self.dropped[reason] += 1
        self._unreported[reason] += 1
        if self.on_drop is not None:
            self.on_drop(reason)
        now = time.monotonic()
        if now - self._last_warning < DROP_WARNING_INTERVAL_S:
            return
        self._last_warning = now
        counts = ", ".join(f"{r} {n}" for r, n in sorted(self._unreported.items()))
        self._unreported.clear()
        shown = "" if key is None else f"; last key {key[:KEY_SHOWN]!r}"
        log.warning("dropped completion-channel messages (%s)%s", counts, shown)

    async def close(self) -> None:
        """Stop receiving; cancel every waiter; release the socket. Completions already
        sent (the engine has shut down, so its writers are drained) are delivered, and
        orphans removed, first."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Sent is not yet received: ZeroMQ's I/O thread may still be moving the last
        # messages from the socket into the queue (a loaded machine); wait a moment for
        # each before deciding none is left.
        while await self._socket.poll(timeout=DRAIN_WAIT_MS):
            self._handle(await self._socket.recv_multipart(copy=False))
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        for future in self._waiting.values():
            future.cancel()
        self._socket.close()
        self._context.term()
