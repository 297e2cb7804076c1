"""The storage interface every backend implements, and the errors it raises.

A backend stores opaque bytes under server-made keys. Its contract:

* ``put`` publishes atomically: once it returns, the key names the
  complete object; if it raises, no object (and no partial object) exists under it.
  ``put`` takes one buffer or a sequence of them (stored one after another), so a
  caller with a header and tensors' memory never joins them into one copy.
* ``get`` / ``head`` raise :class:`NotFoundError` for a missing key.
* ``delete`` is idempotent; ``delete_many`` deletes a batch of keys the same way.
* ``put(..., expires_at=)`` publishes an object that expires: from that time on
  ``get``/``head``/``exists``/``open_read`` raise :class:`NotFoundError` and ``list``
  leaves it out, at once, whether or not its bytes are gone yet (``clean`` removes
  them where the store does not do it itself). See ``service.storage.expiry``.
* ``list`` pages through the keys under a prefix in ascending key order, starting
  after a given key (S3's ``StartAfter``), so a page boundary never skips or repeats.
  It lists only valid keys (``validate_key``, the check ``get`` applies): an entry
  something else put in the store under a name no key can have is never listed, and a
  page's ``next_after`` is always the last key it lists.
* ``ping`` raises :class:`StorageUnavailableError` when the store cannot be reached.
* Blocking work runs on the backend's own thread pool, never on the event loop.

Backends never record metrics: :func:`service.storage.open_storage` wraps each one in
:class:`service.storage.instrumented.InstrumentedStorage`, which reports every call as a
:class:`StorageOp` to a :class:`StorageObserver`. Optional features (a presigned URL, a
streamed read) are methods of this interface with a default, so callers never need to
know which backend, or which wrapper, they hold. The contract test suite in
``tests/storage/contract.py`` pins all of it.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol, TypeVar

# The errors live in a leaf module so that ``keys`` (which raises InvalidKeyError) needs
# nothing from here; they stay importable from ``service.storage.base`` as before.
from service.storage.errors import (
    AlreadyExistsError,
    IntegrityError,
    InvalidKeyError,
    NotFoundError,
    StorageConfigError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
)
from service.storage.keys import is_key, validate_key, validate_key_prefix
from service.threads import named_pool

__all__ = [
    "CHUNK",
    "AlreadyExistsError",
    "Buffer",
    "Data",
    "IntegrityError",
    "InvalidKeyError",
    "NotFoundError",
    "ObjectInfo",
    "ObjectPage",
    "ObjectReader",
    "ObjectRef",
    "Source",
    "Storage",
    "StorageConfigError",
    "StorageError",
    "StorageFullError",
    "StorageObserver",
    "StorageOp",
    "StorageUnavailableError",
    "StoreUsage",
    "Swept",
    "ThreadedStorage",
    "check_listing",
]

_T = TypeVar("_T")
CHUNK = 8 * 1024 * 1024
Buffer = bytes | bytearray | memoryview
#: What ``put`` stores: one buffer, or buffers stored one after another.
Data = Buffer | Sequence[Buffer]


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """A published object: its key, full URI, size in bytes and SHA-256 (hex)."""

    key: str
    uri: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: its key, size in bytes and when it was published (UTC)."""

    key: str
    size: int
    created: datetime


@dataclass(frozen=True, slots=True)
class ObjectPage:
    """One page of a listing; ``next_after`` is the key to continue after, or None."""

    objects: tuple[ObjectInfo, ...]
    next_after: str | None


@dataclass(frozen=True, slots=True)
class Swept:
    """What one ``clean`` removed: expired objects, and orphans (temp files and expiry
    records no writer or object owns any more)."""

    expired: int = 0
    orphan: int = 0


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """The whole store's state, for a store that is not endless (Mooncake's memory):
    bytes held, capacity, objects, and objects its own eviction removed so far."""

    bytes: int
    capacity_bytes: int
    objects: int
    evicted_objects: int


@dataclass(frozen=True, slots=True)
class StorageOp:
    """One storage call as the metrics wrapper saw it (plain data: it crosses processes)."""

    backend: str
    operation: str
    seconds: float
    written: int = 0
    read: int = 0
    error: str | None = None
    """The failure's :attr:`StorageError.kind` (``internal`` for other exceptions)."""
    retries: int = 0
    """Client retries (S3: botocore attempts) made since the previous call was reported."""


class StorageObserver(Protocol):
    """Receives every storage call of an instrumented backend."""

    def observe(self, op: StorageOp) -> None:
        """Record ``op``; called from any thread, must not block."""


@dataclass(frozen=True, slots=True)
class ObjectReader:
    """An object opened for a streamed read: its size and its bytes in pieces."""

    size: int
    chunks: AsyncIterator[bytes]


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


class Source:
    """Bytes to publish, from memory (one or more buffers) or from a local file.

    Backends read it in pieces (parts, write chunks) without loading a file whole or
    joining buffers, except where one read spans two of them.
    """

    def __init__(self, data: Data | None = None, path: Path | None = None):
        if (data is None) == (path is None):
            raise TypeError("give exactly one of data or path")
        self.path = path
        self._views: list[memoryview] | None = None
        if data is None:
            self.size = os.stat(path).st_size  # type: ignore[arg-type]
            return
        buffers = [data] if isinstance(data, bytes | bytearray | memoryview) else data
        self._views = [memoryview(b).cast("B") for b in buffers]
        self.size = sum(v.nbytes for v in self._views)

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Return up to ``length`` bytes starting at ``offset``."""
        if self._views is None:
            assert self.path is not None
            with open(self.path, "rb") as f:
                return os.pread(f.fileno(), length, offset)
        pieces, start = [], 0
        for view in self._views:
            end = start + view.nbytes
            if end > offset and start < offset + length:
                pieces.append(view[max(offset - start, 0) : offset + length - start])
            start = end
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def chunks(self, size: int = CHUNK) -> Iterator[bytes | memoryview]:
        """Yield the whole content in pieces of at most ``size`` bytes."""
        if self._views is not None:
            for view in self._views:
                for offset in range(0, view.nbytes, size):
                    yield view[offset : offset + size]
            return
        assert self.path is not None
        with open(self.path, "rb") as f:
            while piece := f.read(size):
                yield piece

    def sha256(self) -> str:
        """SHA-256 of the whole content, hex."""
        digest = hashlib.sha256()
        for piece in self.chunks():
            digest.update(piece)
        return digest.hexdigest()


class Storage(abc.ABC):
    """An object store for hidden-state files, addressed by server-made keys."""

    #: Short backend name used in metrics labels and logs (``file``, ``s3``).
    scheme: str = ""
    #: How the writer lays an object out for this store: ``safetensors`` (the object is
    #: its safetensors file), or ``packed`` (hs-connectors' Mooncake layout,
    #: ``service.packed``, which ``GET /objects`` turns back into safetensors).
    container: str = "safetensors"
    #: Whether ``put(..., expires_at=)`` works; the API refuses ``ttl_s`` otherwise.
    expires: bool = True

    @abc.abstractmethod
    def uri(self, key: str) -> str:
        """Full URI of ``key`` (``file:///...``, ``s3://bucket/...``). Raises InvalidKeyError."""

    @abc.abstractmethod
    async def put(self, key: str, data: Data, *, expires_at: int | None = None) -> ObjectRef:
        """Publish ``data`` (one buffer, or buffers one after another) under ``key``
        atomically and durably. The buffers are not used after it returns.

        ``expires_at`` (UTC unix seconds) makes the object expire then: it is never
        published without it (``service.storage.expiry``).

        Raises AlreadyExistsError (create-only), InvalidKeyError, or StorageError; on any
        error no object exists under ``key``.
        """

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """Return the object's bytes. Raises NotFoundError, IntegrityError."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectRef:
        """Return the object's size and SHA-256 without reading it to the caller.

        Raises NotFoundError.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Remove every object of ``keys`` (missing ones are not an error).

        All keys are validated before any is deleted. The default deletes one by one; a
        store with a batch call (S3's DeleteObjects) uses it.
        """
        for key in keys:
            validate_key(key)
        for key in keys:
            await self.delete(key)

    @abc.abstractmethod
    async def ping(self) -> None:
        """Check that the store is reachable and writable. Raises StorageUnavailableError."""

    async def clean(self) -> Swept:
        """Remove expired objects' bytes and orphans; what the API's sweeper calls.

        The default removes nothing: a store that expires objects itself (S3, by the
        bucket's lifecycle rules on the expiry tags) needs no sweep.
        """
        return Swept()

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        """Objects whose keys start with ``prefix``, in ascending key order, after ``after``.

        At most ``limit`` objects (1 or more); ``next_after`` is set when more may follow.
        Raises InvalidKeyError for a prefix no key could have, StorageError otherwise.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list objects")

    @abc.abstractmethod
    async def close(self) -> None:
        """Release threads, clients and connections. Idempotent."""

    @property
    def retries(self) -> int:
        """Retries the backend's client has made so far (monotonic); 0 if it never retries."""
        return 0

    # -- optional features: defaults that work for any backend -------------------------

    async def exists(self, key: str) -> bool:
        """Whether an object exists under ``key``, without reading or checksumming it."""
        try:
            await self.head(key)
        except NotFoundError:
            return False
        return True

    async def open_read(self, key: str) -> ObjectReader:
        """Open the object for a streamed read. Raises NotFoundError.

        The default reads it whole; a backend that can stream (local files) does.
        """
        data = await self.get(key)
        return ObjectReader(len(data), _once(data))

    def usage(self) -> StoreUsage | None:
        """The whole store's bytes, capacity and evictions, where the store is bounded
        and says so (Mooncake); None for disks and buckets. Called from any thread."""
        return None

    def presigned_url(self, key: str) -> str | None:
        """A short-lived URL a client can GET the object from directly; None if the
        backend has no such thing (then read it with ``open_read``)."""
        return None


class ThreadedStorage(Storage):
    """A backend whose I/O is blocking (files, boto3): each call runs on its own pool.

    Subclasses implement the blocking ``_publish``, ``_get``, ``_head``, ``_delete`` and
    ``_ping``; this class keeps them off the event loop.
    """

    def __init__(self, io_threads: int, name: str) -> None:
        self._pool = named_pool(io_threads, name)

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def put(self, key: str, data: Data, *, expires_at: int | None = None) -> ObjectRef:
        return await self._run(self._publish, key, Source(data=data), expires_at)

    async def get(self, key: str) -> bytes:
        return await self._run(self._get, key)

    async def head(self, key: str) -> ObjectRef:
        return await self._run(self._head, key)

    async def delete(self, key: str) -> None:
        await self._run(self._delete, key)

    async def ping(self) -> None:
        await self._run(self._ping)

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        check_listing(prefix, limit, after)
        return await self._run(self._list_keys, prefix, limit, after)

    def _list_keys(self, prefix: str, limit: int, after: str | None) -> ObjectPage:
        """``_list``'s pages with only valid keys, each ending on the last key it lists.

        A backend may skip entries that are not keys and still report the last name it
        saw as where to continue (S3 does: a whole page of foreign names must not make
        the listing start over). Such a name cannot be a cursor, since ``after`` must be
        a key: continue from it here until the page is full or the listing ends.
        """
        objects: list[ObjectInfo] = []
        while True:
            page = self._list(prefix, limit - len(objects), after)
            objects += [o for o in page.objects if is_key(o.key)]
            if page.next_after is None:
                return ObjectPage(tuple(objects), None)
            if len(objects) >= limit:
                return ObjectPage(tuple(objects), objects[-1].key)
            after = page.next_after

    async def close(self) -> None:
        self._pool.shutdown(wait=True)

    @abc.abstractmethod
    def _publish(self, key: str, source: Source, expires_at: int | None) -> ObjectRef: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def _head(self, key: str) -> ObjectRef: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _ping(self) -> None: ...

    @abc.abstractmethod
    def _list(self, prefix: str, limit: int, after: str | None) -> ObjectPage: ...


def check_listing(prefix: str, limit: int, after: str | None) -> None:
    """Refuse a listing no key could answer: a prefix with ``..``, ``//``, a leading
    ``/``, or characters keys never hold; a limit below 1; a bad ``after`` key."""
    validate_key_prefix(prefix)
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if after is not None:
        validate_key(after)
