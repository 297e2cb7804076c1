"""The worker-side writer pool: validate, serialise and write objects through service.storage.

It runs one asyncio loop on its own thread (:class:`LoopThread`: the storage interface
is async; vLLM's worker is not), bounds concurrent writes, and accounts for the bytes
copied out of the KV cache but not yet durable (:class:`InFlightBudget`). The connector
reserves bytes before each copy-out; past the ceiling it keeps the request's blocks
held instead, so memory stays bounded and the scheduler
slows down when storage is slow. Objects are encoded (``service.codecs``) here, off the
forward pass; once encoded, an object counts at its encoded size.

Every object ends in exactly one :class:`~service.engine.wire.Completion` to the API
process; an object answered inline (``return: inline``) is not written at all, its
bytes travel in that completion instead. Each one also carries the storage calls made
since the previous one (the worker's storage is instrumented like the API's, see
``service.metrics``) and the in-flight bytes after its own were released, so the API's
gauge reads 0 once idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from service import codecs
from service.client.models import LayerStatistics
from service.config import StorageSettings
from service.engine.allocator import IDLE_TRIM_S, TRIM_SHARE, Trimmer
from service.engine.completion import CompletionSender
from service.engine.errors import (
    ExtractionError,
    InvalidPromptError,
    InvalidStatesError,
    StorageFullError,
    StorageWriteError,
)
from service.engine.jobs import WriteJob
from service.engine.objects import loss_mask, serialize_parts
from service.engine.statistics import layer_statistics
from service.engine.wire import (
    Completion,
    FailureType,
    StoredObject,
    TransferManifest,
    WriteFailure,
)
from service.packed import pack
from service.storage import ObjectRef, StorageError, StorageOp, open_storage
from service.storage import StorageFullError as StoreFull
from service.storage.expiry import expires_at
from service.threads import name_os_thread, named_pool

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class InFlightBudget:
    """Bytes copied out of the KV cache and not yet durable (or failed), under a ceiling.

    Thread-safe: the worker reserves from the forward pass's thread, the writer shrinks
    and releases from its own.
    """

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self._lock = threading.Lock()
        self._in_flight = 0
        self._peak = 0

    @property
    def in_flight(self) -> int:
        """Bytes reserved now."""
        return self._in_flight

    @property
    def peak(self) -> int:
        """The most bytes ever reserved at once."""
        return self._peak

    def reserve(self, nbytes: int) -> bool:
        """Reserve room for ``nbytes``; False when over the ceiling.

        One object larger than the ceiling is let through when nothing else is in
        flight, or it could never be written.
        """
        with self._lock:
            if self._in_flight and self._in_flight + nbytes > self.ceiling:
                return False
            self._in_flight += nbytes
            self._peak = max(self._peak, self._in_flight)
            return True

    def shrink(self, reserved: int, now: int) -> int:
        """Count a reservation of ``reserved`` bytes as ``now`` from here on, if smaller
        (the host copy went, its encoded bytes stay); returns what it counts now."""
        if now >= reserved:
            return reserved
        with self._lock:
            self._in_flight -= reserved - now
        return now

    def release(self, nbytes: int) -> tuple[int, int]:
        """Give back a reservation of ``nbytes``; returns (in flight, peak) after it."""
        with self._lock:
            self._in_flight -= nbytes
            return self._in_flight, self._peak


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own, for callers that
    are not async (vLLM's worker is not; the storage interface is)."""

    def __init__(
        self,
        name: str,
        executor: ThreadPoolExecutor,
        before: Callable[[], None] = lambda: None,
    ) -> None:
        """Start the loop; ``before`` runs on its thread first, ``executor`` is its
        default executor (``asyncio.to_thread``'s threads)."""
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(executor)
        self._thread = threading.Thread(target=self._run, args=(before,), name=name)
        self._thread.daemon = True
        self._thread.start()

    def _run(self, before: Callable[[], None]) -> None:
        name_os_thread()
        before()
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Schedule ``coro`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop, wait for its thread (up to ``timeout``) and close it."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        self.loop.close()


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


@dataclass(frozen=True)
class _Encoded:
    """A job's object, encoded: what the put and its report need."""

    parts: list[bytes | memoryview]
    """[header, tensor memory...]: the tensors are not copied again, storage writes
    (and hashes) them where they are."""
    copy_s: float
    shape: tuple[int, ...]
    num_tokens: int
    num_loss_tokens: int | None
    layer_ids: tuple[int, ...]
    statistics: LayerStatistics | None
    """None until :meth:`with_statistics` (``encode(..., defer_statistics=True)``)."""
    states: Any = None
    """The states the deferred statistics describe; dropped once they are computed."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self.parts)

    def with_statistics(self) -> _Encoded:
        """This object with its deferred statistics computed (blocking: run on a thread)."""
        if self.statistics is not None:
            return self
        return dataclasses.replace(self, statistics=layer_statistics(self.states), states=None)

    def stored(
        self,
        key: str,
        ref: ObjectRef,
        write_s: float,
        transfer: TransferManifest | None = None,
    ) -> StoredObject:
        return self._object(key, ref.uri, ref.size, ref.sha256, write_s, transfer=transfer)

    def inline(self, key: str, limit: int, write_s: float) -> StoredObject:
        """The object answered inline: its bytes, written nowhere (``uri`` empty).

        Raises InvalidPromptError (``invalid_request``) past ``limit`` bytes, the
        object's share of the request's limit: the API sizes each object beforehand at
        its longest and refuses a request over the limit, this holds the shares to it
        whatever the API's estimate missed.
        """
        if self.nbytes > limit:
            raise InvalidPromptError(
                f"return: the inline object is {self.nbytes} bytes, over its {limit}-byte "
                "share of limits.max_inline_bytes; ask for return 'storage', fewer "
                "tokens (tokens) or layers, or a smaller codec"
            )
        data = b"".join(self.parts)
        return self._object(
            key, "", len(data), hashlib.sha256(data).hexdigest(), write_s, data=data
        )

    def _object(
        self,
        key: str,
        uri: str,
        size: int,
        sha256: str,
        write_s: float,
        data: bytes | None = None,
        transfer: TransferManifest | None = None,
    ) -> StoredObject:
        """The completion's record of this object, wherever its bytes went."""
        assert self.statistics is not None, "statistics deferred and never computed"
        return StoredObject(
            key=key,
            uri=uri,
            size=size,
            sha256=sha256,
            num_tokens=self.num_tokens,
            shape=self.shape,
            num_loss_tokens=self.num_loss_tokens,
            layer_ids=self.layer_ids,
            statistics=self.statistics,
            copy_s=self.copy_s,
            write_s=write_s,
            data=data,
            transfer=transfer,
        )


def encode(job: WriteJob, *, defer_statistics: bool = False) -> _Encoded:
    """Wait for ``job``'s copy, validate, serialise: one thread hop for all three.

    The per-layer statistics are computed here too, unless ``defer_statistics``: then
    the result keeps the states and :meth:`_Encoded.with_statistics` computes them, so
    that they can run beside the put (they go in the report, not in the object).
    Raises InvalidStatesError for states a reader must not get (``validation.py``).
    """
    import torch

    from service.engine.validation import check_states

    copy_s = job.copy.wait()
    save, tensors = job.save, job.copy.tensors
    layer_ids = save.layer_ids or None
    # Encoded on the GPU: check what a reader will get back. Otherwise the model's
    # states, before any lossy codec: what the statistics describe.
    states = codecs.restore(save.codec, tensors) if job.copy.prepared else job.copy.states
    check_states(states, layer_ids)
    statistics = None if defer_statistics else layer_statistics(states)
    kept = states if defer_statistics else None
    del states
    mask = None if save.loss_spans is None else loss_mask(save.loss_spans, len(save.token_ids))
    token_ids = torch.tensor(save.token_ids, dtype=torch.int64)
    prepared = tensors if job.copy.prepared else None
    positions = None if save.positions is None else torch.tensor(save.positions, dtype=torch.int64)
    parts = serialize_parts(
        save.codec, job.copy.states, token_ids, save.metadata, prepared, mask, positions
    )
    return _Encoded(
        parts=parts,
        copy_s=copy_s,
        shape=tuple(job.copy.states.shape),
        num_tokens=len(save.token_ids),
        num_loss_tokens=None if mask is None else int(mask.sum()),
        layer_ids=save.layer_ids,
        statistics=statistics,
        states=kept,
    )


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
        self.budget = InFlightBudget(max_bytes_in_flight)
        # Freed objects go back to the system in bounded steps (service/engine/allocator.py).
        self._trimmer = Trimmer(max_bytes_in_flight // TRIM_SHARE)
        self._sender = sender
        self._ops = OpBuffer()
        # Encoding runs torch ops in these threads: one intra-op thread each, or every
        # writer spins up its own OpenMP team against the forward pass's cores.
        encoders = named_pool(max_concurrent_writes, "hsx-encode", _one_torch_thread)
        forward_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()

        def prepare_loop_thread() -> None:
            # Off the forward pass's CPUs before any thread of ours is started; one
            # intra-op thread, as the encoders': the loop encodes some objects itself.
            _off_the_forward_pass(forward_cpus)
            _one_torch_thread()

        self._loop = LoopThread("hsx-writer", encoders, prepare_loop_thread)
        self._storage = open_storage(storage, self._ops, factory=storage_factory)
        self._limit = asyncio.Semaphore(max_concurrent_writes)
        self._pending: set[Future[None]] = set()

    def submit(self, job: WriteJob) -> None:
        """Queue ``job`` (its bytes reserved); its completion goes to the sender."""
        future = self._loop.submit(self._write(job))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def report_failure(self, key: str, failure: WriteFailure, nbytes: int = 0) -> None:
        """Report a job that failed before it reached the pool, releasing ``nbytes``."""
        self._loop.call(self._complete(key, nbytes, failure=failure))

    async def _write(self, job: WriteJob) -> None:
        key, nbytes, release = job.key, job.nbytes, job.copy.release
        inline_bytes = job.save.inline_bytes
        stored: StoredObject | None = None
        failure: WriteFailure | None = None
        async with self._limit:
            start = time.perf_counter()
            try:
                aside = inline_bytes is None and _statistics_aside(job)
                if aside and _encodes_in_place(job):
                    encoded = encode(job, defer_statistics=True)  # no thread hop
                else:
                    encoded = await asyncio.to_thread(encode, job, defer_statistics=aside)
                ttl_s = job.save.ttl_s
                del job
                if aside:
                    # No shrink: the host copy stays alive until the statistics have read
                    # it, so it counts at its own size until the release below.
                    stored = await self._put_beside_statistics(key, encoded, ttl_s, start)
                else:
                    # Encoded: the host copy can go, unless the parts are its memory (raw,
                    # and on CUDA the device-encoded codecs: the parts view the pinned
                    # buffer, so it is released only after the put, in `finally`).
                    nbytes = self.budget.shrink(nbytes, encoded.nbytes)
                    if inline_bytes is not None:
                        stored = encoded.inline(key, inline_bytes, time.perf_counter() - start)
                    else:
                        stored = await self._put(key, encoded, ttl_s, start)
            except Exception as exc:
                failure = _failure(exc)
                log.warning("hidden-state object %s not written: %s", key, failure.message)
            finally:
                release()
        await self._complete(key, nbytes, stored=stored, failure=failure)

    async def _put(
        self, key: str, encoded: _Encoded, ttl_s: int | None, start: float
    ) -> StoredObject:
        """Publish ``encoded`` in the store's container; its record once durable."""
        ref, transfer = await self._publish(key, encoded, ttl_s)
        return encoded.stored(key, ref, time.perf_counter() - start, transfer)

    async def _put_beside_statistics(
        self, key: str, encoded: _Encoded, ttl_s: int | None, start: float
    ) -> StoredObject:
        """:meth:`_put`, with the deferred statistics computed on an encode thread
        meanwhile: they fill the put's waits (fsync, the network) instead of coming
        before it. The put's error wins; an object whose statistics fail is removed,
        so that no key stays that no completion reports."""
        statistics = asyncio.ensure_future(asyncio.to_thread(encoded.with_statistics))
        try:
            ref, transfer = await self._publish(key, encoded, ttl_s)
        except BaseException:
            # Never return while a thread still reads the states (released after us).
            await asyncio.wait([statistics])
            raise
        try:
            done = await statistics
        except BaseException:
            with contextlib.suppress(Exception):
                await self._storage.delete(key)
            raise
        return done.stored(key, ref, time.perf_counter() - start, transfer)

    async def _publish(
        self, key: str, encoded: _Encoded, ttl_s: int | None
    ) -> tuple[ObjectRef, TransferManifest | None]:
        """Put ``encoded`` in the store's container; its reference once durable."""
        # The expiry counts from publishing, when the object becomes readable.
        expiry = expires_at(ttl_s)
        if self._storage.container != "packed":
            return await self._storage.put(key, encoded.parts, expires_at=expiry), None
        # hs-connectors' layout: the same tensors (views, not copies) at aligned offsets.
        packed = pack(encoded.parts, key)
        ref = await self._storage.put(key, packed.parts, expires_at=expiry)
        manifest = packed.manifest
        manifest["metadata"]["sha256"] = ref.sha256
        return ref, TransferManifest.model_validate(manifest)

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
        in_flight, peak = self.budget.release(nbytes)
        completion = Completion(
            key=key,
            stored=stored,
            failure=failure,
            bytes_in_flight=in_flight,
            peak_bytes_in_flight=peak,
            storage_ops=self._ops.drain(),
        )
        self._sender.send(completion)
        # Trims after the answer has left: they take milliseconds.
        self._trimmer.released(nbytes)
        if in_flight == 0:
            mark = self._trimmer.releases
            asyncio.get_running_loop().call_later(IDLE_TRIM_S, self._trim_if_idle, mark)

    def _trim_if_idle(self, mark: int) -> None:
        """The idle timer: trim if nothing was reserved or released since it started."""
        if self.budget.in_flight == 0 and self._trimmer.releases == mark:
            self._trimmer.trim()

    def close(self, timeout: float = 60.0) -> None:
        """Wait for queued writes (up to ``timeout``), then release everything."""
        deadline = time.monotonic() + timeout
        for future in list(self._pending):
            future.exception(timeout=max(0.0, deadline - time.monotonic()))
        self._loop.call(self._storage.close())
        self._loop.call(self._close_sender())
        self._loop.close()

    async def _close_sender(self) -> None:
        self._sender.close()


def _failure(exc: Exception) -> WriteFailure:
    """What the caller is told of a write that raised ``exc``: the error type of its
    ``service.engine.errors`` class."""
    if isinstance(exc, InvalidStatesError):
        return WriteFailure(type=_type_of(exc), message=str(exc), reason=exc.reason)
    if isinstance(exc, InvalidPromptError):  # the request's own limit (inline size)
        return WriteFailure(type=_type_of(exc), message=str(exc))
    if isinstance(exc, StoreFull):
        return WriteFailure(type=_type_of(StorageFullError), message=str(exc))
    error = StorageWriteError if isinstance(exc, StorageError) else ExtractionError
    return WriteFailure(type=_type_of(error), message=f"{type(exc).__name__}: {exc}")


def _type_of(error: ExtractionError | type[ExtractionError]) -> FailureType:
    # Every class a writer reports has a wire name (wire.FailureType).
    return cast(FailureType, error.error_type)


#: States of at least this many bytes get their statistics beside the put; smaller ones
#: before it, on the same thread hop as the validation (a second hop would cost more
#: than the statistics of a small object take).
STATISTICS_ASIDE_BYTES = 1 << 20


def _statistics_aside(job: WriteJob) -> bool:
    """Whether ``job``'s statistics run beside its put: large states copied to host
    memory as they are. Device-encoded ones (``copy.prepared``) keep theirs before it,
    which would otherwise hold a decoded full-precision copy through the put."""
    return not job.copy.prepared and job.copy.states.nbytes >= STATISTICS_ASIDE_BYTES


def _encodes_in_place(job: WriteJob) -> bool:
    """Whether ``job`` (its statistics beside the put) is encoded on the writer's loop
    thread instead of an encode thread: the ``raw`` codec of a completed copy, where the
    encoding is the validation (two reductions, about 0.05 ms per MiB) and a header over
    the tensors' own memory. Each hop to a thread and back cost about 0.75 ms right after
    a forward pass (docs/profile.md, sixth stop); every other codec transforms the
    states, and an unfinished CUDA copy would block the loop while it waits."""
    return job.save.codec == "raw" and job.copy.done()


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
