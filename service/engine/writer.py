"""The worker-side writer pool: validate, serialise and write objects through service.storage.

It runs one asyncio loop on its own thread (the storage interface is async; vLLM's worker
is not), bounds concurrent writes, and accounts for the bytes copied out of the KV cache
but not yet durable. The connector reserves bytes before each copy-out; past the ceiling
it keeps the request's blocks held instead, so memory stays bounded and the scheduler
slows down when storage is slow. Objects are encoded (``service.codecs``) here, off the
forward pass; once encoded, an object counts at its encoded size.

Every object ends in exactly one :class:`~service.engine.wire.Completion` to the API
process. Each one also carries the storage calls made since the previous one (the
worker's storage is instrumented like the API's, see ``service.metrics``) and the
in-flight bytes after its own were released, so the API's gauge reads 0 once idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service import codecs
from service.codecs import Codec
from service.config import StorageSettings
from service.engine.completion import CompletionSender
from service.engine.errors import InvalidStatesError
from service.engine.objects import serialize_parts
from service.engine.wire import Completion, StoredObject, WriteFailure
from service.storage import StorageError, StorageOp, open_storage

log = logging.getLogger(__name__)


@dataclass
class WriteJob:
    """One object to write: its states are on the host, or being copied there."""

    key: str
    hidden_states: Any
    token_ids: Any
    metadata: Mapping[str, str]
    nbytes: int
    #: uint8 [num_tokens], 1 on supervised tokens, when the request asked for a loss mask.
    loss_mask: Any = None
    #: Blocks until the states are on the host; returns the copy's duration in seconds.
    wait_copied: Callable[[], float] = field(default=lambda: 0.0)
    release: Callable[[], None] = field(default=lambda: None)  # e.g. return a pinned buffer
    codec: Codec = "raw"
    #: The codec's device stage already ran (CUDA): its host tensors. ``hidden_states``
    #: is then their ``hidden_states`` (same shape; fp8 or bf16 values).
    prepared: dict[str, Any] | None = None


class OpBuffer:
    """The worker's storage observer: keeps calls until the next completion takes them."""

    def __init__(self) -> None:
        self._ops: deque[StorageOp] = deque()

    def observe(self, op: StorageOp) -> None:
        self._ops.append(op)  # deque.append is atomic: safe from the storage's threads

    def drain(self) -> tuple[StorageOp, ...]:
        """Every call observed so far, oldest first, and forget them."""
        ops = []
        while self._ops:
            ops.append(self._ops.popleft())
        return tuple(ops)


class WriterPool:
    """Writes jobs to storage on a private event loop; reports each via ``sender``."""

    def __init__(
        self,
        storage: StorageSettings,
        sender: CompletionSender,
        *,
        max_bytes_in_flight: int,
        max_concurrent_writes: int,
        storage_factory: str | None = None,
    ) -> None:
        self.max_bytes_in_flight = max_bytes_in_flight
        self._sender = sender
        self._lock = threading.Lock()
        self._in_flight = 0
        self._peak = 0
        self._ops = OpBuffer()
        self._loop = asyncio.new_event_loop()
        # Encoding runs torch ops in these threads: one intra-op thread each, or every
        # writer spins up its own OpenMP team against the forward pass's cores.
        self._loop.set_default_executor(
            ThreadPoolExecutor(max_concurrent_writes, "hsx-encode", _one_torch_thread)
        )
        forward_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self._thread = threading.Thread(
            target=self._run_loop, args=(forward_cpus,), name="hsx-writer"
        )
        self._thread.daemon = True
        self._thread.start()
        self._storage = open_storage(storage, self._ops, factory=storage_factory)
        self._limit = asyncio.Semaphore(max_concurrent_writes)
        self._pending: set[Future[None]] = set()

    def _run_loop(self, forward_cpus: set[int]) -> None:
        _off_the_forward_pass(forward_cpus)  # before any thread of ours is started
        self._loop.run_forever()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def bytes_in_flight(self) -> int:
        """Bytes copied out of the KV cache and not yet durable (or failed)."""
        return self._in_flight

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve room for ``nbytes``; False when over the ceiling.

        One object larger than the ceiling is let through when nothing else is in
        flight, or it could never be written.
        """
        with self._lock:
            if self._in_flight and self._in_flight + nbytes > self.max_bytes_in_flight:
                return False
            self._in_flight += nbytes
            self._peak = max(self._peak, self._in_flight)
            return True

    def _shrink(self, job: WriteJob, encoded: int) -> None:
        """Count ``job`` at its encoded size from now on (the host copy is released)."""
        with self._lock:
            if encoded < job.nbytes:
                self._in_flight -= job.nbytes - encoded
                job.nbytes = encoded

    def submit(self, job: WriteJob) -> None:
        """Queue ``job`` (its bytes reserved); its completion goes to the sender."""
        future = asyncio.run_coroutine_threadsafe(self._write(job), self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def report_failure(self, key: str, failure: WriteFailure, nbytes: int = 0) -> None:
        """Report a job that failed before it reached the pool, releasing ``nbytes``."""
        self._call(self._complete(key, nbytes, failure=failure))

    async def _write(self, job: WriteJob) -> None:
        async with self._limit:
            start = time.perf_counter()
            stored: StoredObject | None = None
            failure: WriteFailure | None = None
            try:
                copy_s, parts = await asyncio.to_thread(self._prepare, job)
                shape = tuple(job.hidden_states.shape)
                # Encoded: the host copy can go, unless the parts are its memory (raw,
                # and on CUDA the device-encoded codecs: the parts view the pinned
                # buffer, so it is released only after the put, in `finally`).
                job.hidden_states = job.prepared = None
                self._shrink(job, sum(memoryview(p).nbytes for p in parts))
                ref = await self._storage.put(job.key, parts)
                stored = StoredObject(
                    key=job.key,
                    uri=ref.uri,
                    size=ref.size,
                    sha256=ref.sha256,
                    num_tokens=int(job.token_ids.shape[0]),
                    shape=shape,
                    num_loss_tokens=_count(job.loss_mask),
                    copy_s=copy_s,
                    write_s=time.perf_counter() - start,
                )
            except Exception as exc:
                failure = _failure(exc)
                log.warning("hidden-state object %s not written: %s", job.key, failure.message)
            finally:
                _release(job)
        await self._complete(job.key, job.nbytes, stored=stored, failure=failure)

    def _prepare(self, job: WriteJob) -> tuple[float, list[bytes | memoryview]]:
        """Wait for the copy, validate, serialise: one thread hop for all three.

        Returns the copy's duration and the object as [header, tensor memory...]: the
        tensors are not copied again, storage writes (and hashes) them where they are.
        """
        from service.engine.validation import check_states

        copy_s = job.wait_copied()
        layer_ids = json.loads(job.metadata.get("layer_ids", "null"))
        if job.prepared is None:
            check_states(job.hidden_states, layer_ids)
        else:  # encoded on the GPU: check what a reader will get back
            check_states(codecs.restore(job.codec, job.prepared), layer_ids)
        return copy_s, serialize_parts(
            job.codec, job.hidden_states, job.token_ids, job.metadata, job.prepared, job.loss_mask
        )

    async def _complete(
        self,
        key: str,
        nbytes: int,
        *,
        stored: StoredObject | None = None,
        failure: WriteFailure | None = None,
    ) -> None:
        # Release and send without an await between them: messages leave in the order
        # of releases, so the last one reports what is left in flight (0 when idle).
        with self._lock:
            self._in_flight -= nbytes
            in_flight, peak = self._in_flight, self._peak
        completion = Completion(
            key=key,
            stored=stored,
            failure=failure,
            bytes_in_flight=in_flight,
            peak_bytes_in_flight=peak,
            storage_ops=self._ops.drain(),
        )
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


def _release(job: WriteJob) -> None:
    """Run ``job``'s release once (after encoding, or on failure)."""
    release, job.release = job.release, _nothing
    release()


def _nothing() -> None:
    pass


def _count(loss_mask: Any) -> int | None:
    return None if loss_mask is None else int(loss_mask.sum())


def _failure(exc: Exception) -> WriteFailure:
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, InvalidStatesError):
        return WriteFailure(type="invalid_hidden_states", message=str(exc), reason=exc.reason)
    if isinstance(exc, StorageError):
        return WriteFailure(type="storage_error", message=message)
    return WriteFailure(type="internal_error", message=message)


def _off_the_forward_pass(forward_cpus: set[int]) -> None:
    """Keep this thread, and every thread it starts, from slowing the forward pass.

    Linux threads inherit CPU affinity and nice value from the thread that starts them,
    and the writer's threads (encoders, the storage's I/O threads) are all started from
    this one. vLLM's CPU worker binds the forward pass's thread to one CPU before our
    connector starts, so without this every writer thread would share that CPU with it.
    """
    others = set(range(os.cpu_count() or 1)) - forward_cpus
    if others and hasattr(os, "sched_setaffinity"):
        # The kernel keeps only the CPUs our cpuset allows; none left raises, and then
        # the writers stay where they are.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, others)


def _one_torch_thread() -> None:
    """One intra-op thread for this thread. vLLM's CPU worker replaces the public
    ``torch.set_num_threads`` with a no-op (it would undo its core binding); the binding
    belongs to the forward pass's thread, and this call changes only the calling thread's
    OpenMP team (and the default of threads started later)."""
    import torch

    torch._C.set_num_threads(1)
