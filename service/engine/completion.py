"""The channel that tells the API process an object is durable (or failed).

We use a ZeroMQ PUSH/PULL pair over an IPC socket rather than vLLM's KV-connector stats
path: stats are aggregated and delivered on the logging interval (seconds, batched,
meant for metrics), while a request waits on its own completion and needs it at once,
carrying an error message. pyzmq ships with vLLM, and vLLM itself talks between its
processes this way. The worker (tensor-parallel rank 0) PUSHes one message per object;
the API process binds the PULL end before the engine starts and resolves one future per
object key. Keys are unique and made by the server, so they are the correlation id.
Messages are :class:`service.engine.wire.Completion` (JSON, validated on receipt); they
also carry the worker's storage calls for ``/metrics`` (why there: ``service.metrics``).

The socket is ``ipc://`` by default (the writing rank on the API's host: TP within a
node), or ``tcp://`` (``engine.completion_address``) where the writing rank can run on
another node. Either way the writer's first message is a ``WriterHello``, and start-up
waits for it: a writer that cannot reach the API stops the server with one line
instead of leaving every request to hang until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
from pydantic import TypeAdapter

from service.config import split_tcp
from service.engine.wire import ChannelMessage, Completion, WriterHello

log = logging.getLogger(__name__)

__all__ = ["Completion", "CompletionReceiver", "CompletionSender"]

#: How long closing waits for one more completion before it takes the queue as empty.
DRAIN_WAIT_MS = 100
_MESSAGES: TypeAdapter[ChannelMessage] = TypeAdapter(ChannelMessage)


class CompletionSender:
    """Worker side: PUSH completions (one socket, used from one thread)."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 5000)  # flush on close, but never hang forever
        self._socket.connect(address)

    def send(self, completion: Completion) -> None:
        """Queue one message (ZeroMQ sends it on its own I/O thread)."""
        self._socket.send(completion.encode())

    def hello(self) -> None:
        """Tell the API this writer reaches it (sent once, before any completion)."""
        hello = WriterHello(writer_pid=os.getpid(), host=socket.gethostname())
        self._socket.send(hello.model_dump_json().encode())

    def close(self) -> None:
        """Close, flushing queued messages for up to the linger time."""
        self._socket.close()
        self._context.term()


class CompletionReceiver:
    """API side: PULL completions and resolve the future waiting on each key.

    ``expect`` is called before the request is submitted, so a completion never
    precedes its waiter. One for a key nobody waits on any more (the request was
    cancelled) goes to ``on_orphan``. Every message, waited on or not, is first shown
    to ``on_message`` (metrics).
    """

    def __init__(self, address: str) -> None:
        """Listen on ``address``: ``ipc://PATH``, or ``tcp://HOST:PORT`` (bound on every
        interface; ``address`` then names the port the writer connects to, a free one
        for PORT 0)."""
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://"):
            host, port = split_tcp(address)
            self._socket.bind(f"tcp://*:{port}" if port else "tcp://*:*")
            bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            address = f"tcp://{host}:{bound.rsplit(':', 1)[1]}"
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
        #: Called with every completion received.
        self.on_message: Callable[[Completion], None] | None = None

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
            self._handle(await self._socket.recv())

    def _handle(self, raw: bytes) -> None:
        try:
            message = _MESSAGES.validate_json(raw)
        except ValueError as exc:  # pydantic's ValidationError is one
            log.error("dropping a malformed completion message: %s", exc)
            return
        if isinstance(message, WriterHello):
            log.info("hsx: writer pid %d on %s reached the API", message.writer_pid, message.host)
            self._hellos += 1
            if self._hellos >= self.writers:
                self.writer_ready.set()
            return
        completion = message
        if self.on_message is not None:
            try:
                self.on_message(completion)
            except Exception:  # metrics must never stop delivery
                log.exception("completion observer failed")
        self._deliver(completion)

    def _deliver(self, completion: Completion) -> None:
        key = completion.key
        if key in self._abandoned:
            self._abandoned.discard(key)
            self._dispatch_orphan(completion)
            return
        future = self._waiting.pop(key, None)
        if future is None:
            log.warning("dropping a completion for unknown key %s", key)
        elif not future.done():
            future.set_result(completion)

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
            self._handle(await self._socket.recv())
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        for future in self._waiting.values():
            future.cancel()
        self._socket.close()
        self._context.term()
