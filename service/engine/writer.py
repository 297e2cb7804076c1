"""The worker-side writer pool: serialise objects and write them through service.storage.

It runs one asyncio loop on its own thread (the storage interface is async; vLLM's worker
is not), bounds concurrent writes, and accounts for the bytes copied out of the KV cache
but not yet durable. The connector reserves bytes before each copy-out; past the ceiling
it keeps the request's blocks held instead, so memory stays bounded and the scheduler
slows down when storage is slow. Objects are encoded (``service.codecs``) here, off the
forward pass; once encoded, an object counts at its encoded size.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.codecs import Codec
from service.config import StorageSettings
from service.engine.completion import Completion, CompletionSender
from service.engine.objects import serialize
from service.storage import open_storage

log = logging.getLogger(__name__)


@dataclass
class WriteJob:
    """One object to write: its tensors are already on the host."""

    key: str
    hidden_states: Any
    token_ids: Any
    metadata: Mapping[str, str]
    nbytes: int
    copy_s: float
    bytes_in_flight: int
    wait_ready: Callable[[], None] = field(default=lambda: None)  # e.g. a CUDA event
    release: Callable[[], None] = field(default=lambda: None)  # e.g. return a pinned buffer
    codec: Codec = "raw"
    #: The codec's device stage already ran (CUDA): its host tensors. ``hidden_states``
    #: is then their ``hidden_states`` (same shape; fp8 or bf16 values).
    prepared: dict[str, Any] | None = None


class WriterPool:
    """Writes jobs to storage on a private event loop; reports each via ``sender``."""

    def __init__(
        self,
        storage: StorageSettings,
        sender: CompletionSender,
        *,
        max_bytes_in_flight: int,
        max_concurrent_writes: int,
        storage_factory: Callable[[StorageSettings], Any] = open_storage,
    ) -> None:
        self.max_bytes_in_flight = max_bytes_in_flight
        self._sender = sender
        self._lock = threading.Lock()
        self._in_flight = 0
        self._loop = asyncio.new_event_loop()
        # Encoding runs torch ops in these threads: one intra-op thread each, or every
        # writer spins up its own OpenMP team against the forward pass's cores.
        self._loop.set_default_executor(
            ThreadPoolExecutor(max_concurrent_writes, "hsx-encode", _one_torch_thread)
        )
        self._thread = threading.Thread(target=self._loop.run_forever, name="hsx-writer")
        self._thread.daemon = True
        self._thread.start()
        self._storage = storage_factory(storage)
        self._limit = asyncio.Semaphore(max_concurrent_writes)
        self._pending: set[Future[None]] = set()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def bytes_in_flight(self) -> int:
        """Bytes copied out of the KV cache and not yet durable (or failed)."""
        return self._in_flight

    def try_reserve(self, nbytes: int) -> int | None:
        """Reserve room for ``nbytes``; None when over the ceiling.

        One object larger than the ceiling is let through when nothing else is in
        flight, or it could never be written. Returns the in-flight total after it.
        """
        with self._lock:
            if self._in_flight and self._in_flight + nbytes > self.max_bytes_in_flight:
                return None
            self._in_flight += nbytes
            return self._in_flight

    def release(self, nbytes: int) -> None:
        """Give back a reservation that was never submitted."""
        with self._lock:
            self._in_flight -= nbytes

    def _shrink(self, job: WriteJob, encoded: int) -> None:
        """Count ``job`` at its encoded size from now on (the host copy is released)."""
        with self._lock:
            if encoded < job.nbytes:
                self._in_flight -= job.nbytes - encoded
                job.nbytes = encoded

    def submit(self, job: WriteJob) -> None:
        """Queue ``job``; its completion (success or error) goes to the sender."""
        future = asyncio.run_coroutine_threadsafe(self._write(job), self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    async def _write(self, job: WriteJob) -> None:
        async with self._limit:
            start = time.perf_counter()
            try:
                await asyncio.to_thread(job.wait_ready)
                data = await asyncio.to_thread(
                    serialize,
                    job.codec,
                    job.hidden_states,
                    job.token_ids,
                    job.metadata,
                    job.prepared,
                )
                shape = tuple(job.hidden_states.shape)
                job.hidden_states = job.prepared = None  # encoded: the host copy can go
                job.release()
                self._shrink(job, len(data))
                ref = await self._storage.put(job.key, data)
                completion = Completion(
                    key=job.key,
                    ok=True,
                    size=ref.size,
                    sha256=ref.sha256,
                    uri=ref.uri,
                    num_tokens=int(job.token_ids.shape[0]),
                    shape=shape,
                    copy_s=job.copy_s,
                    write_s=time.perf_counter() - start,
                    bytes_in_flight=job.bytes_in_flight,
                )
            except Exception as exc:
                job.release()
                log.warning("hidden-state write failed for %s: %s", job.key, exc)
                completion = Completion(
                    key=job.key,
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}",
                    bytes_in_flight=job.bytes_in_flight,
                )
            finally:
                self.release(job.nbytes)
        self._sender.send(completion)

    def report_failure(self, key: str, error: str) -> None:
        """Report a job that failed before it reached the pool (e.g. in copy-out)."""
        completion = Completion(key=key, ok=False, error=error)
        self._call(self._send(completion))

    async def _send(self, completion: Completion) -> None:
        self._sender.send(completion)

    def close(self, timeout: float = 60.0) -> None:
        """Wait for queued writes (up to ``timeout``), then release everything."""
        deadline = time.monotonic() + timeout
        for future in list(self._pending):
            future.exception(timeout=max(0.0, deadline - time.monotonic()))
        self._call(self._storage.close())
        self._call(self._close_sender())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _close_sender(self) -> None:
        self._sender.close()


def _one_torch_thread() -> None:
    """One intra-op thread for this thread. vLLM's CPU worker replaces the public
    ``torch.set_num_threads`` with a no-op (it would undo its core binding); the binding
    belongs to the forward pass's thread, and this call changes only the calling thread's
    OpenMP team (and the default of threads started later)."""
    import torch

    torch._C.set_num_threads(1)
