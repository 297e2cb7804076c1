"""The channel that tells the API process an object is durable (or failed).

We use a ZeroMQ PUSH/PULL pair over an IPC socket rather than vLLM's KV-connector stats
path: stats are aggregated and delivered on the logging interval (seconds, batched,
meant for metrics), while a request waits on its own completion and needs it at once,
carrying an error message. pyzmq ships with vLLM, and vLLM itself talks between its
processes this way. The worker (tensor-parallel rank 0) PUSHes one message per object;
the API process binds the PULL end before the engine starts and resolves one future per
object key. Keys are unique and made by the server, so they are the correlation id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """Outcome of writing one object."""

    key: str
    ok: bool
    size: int = 0
    sha256: str = ""
    uri: str = ""
    error: str = ""
    num_tokens: int = 0
    shape: tuple[int, ...] = ()
    copy_s: float = 0.0
    write_s: float = 0.0
    bytes_in_flight: int = 0  # the writer's in-flight bytes right after this copy-out

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Completion:
        data: dict[str, Any] = json.loads(raw)
        data["shape"] = tuple(data.get("shape", ()))
        return cls(**data)


class CompletionSender:
    """Worker side: PUSH completions (one socket, used from one thread)."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 5000)  # flush on close, but never hang forever
        self._socket.connect(address)

    def send(self, completion: Completion) -> None:
        self._socket.send(completion.encode())

    def close(self) -> None:
        self._socket.close()
        self._context.term()


class CompletionReceiver:
    """API side: PULL completions and resolve the future waiting on each key.

    ``expect`` is called before the request is submitted, so a completion never
    precedes its waiter. One for a key nobody waits on any more (the request was
    cancelled) goes to ``on_orphan``.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._waiting: dict[str, asyncio.Future[Completion]] = {}
        self._abandoned: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self.on_orphan: Any = None  # async callable(Completion) for abandoned keys

    def start(self) -> None:
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

    def abandon(self, key: str) -> None:
        """Nobody waits for ``key`` any more; its completion goes to ``on_orphan``."""
        future = self._waiting.pop(key, None)
        if future is not None and future.done() and not future.cancelled():
            self._dispatch_orphan(future.result())
            return
        if future is not None:
            future.cancel()
        self._abandoned.add(key)

    def _dispatch_orphan(self, completion: Completion) -> None:
        if self.on_orphan is not None:
            asyncio.get_running_loop().create_task(self.on_orphan(completion))

    async def _loop(self) -> None:
        while True:
            raw = await self._socket.recv()
            try:
                completion = Completion.decode(raw)
            except (ValueError, TypeError):
                log.exception("dropping a malformed completion message")
                continue
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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for future in self._waiting.values():
            future.cancel()
        self._socket.close()
        self._context.term()
