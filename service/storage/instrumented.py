"""The one metrics decorator around every storage backend.

``service.storage.open_storage`` applies it to every backend it builds, in the API
process and in the engine's worker alike. Backends stay free of metrics code; this
wrapper times each call, counts bytes, classifies errors (by the error's ``kind``) and
reads the client's retries, and hands each call to a :class:`StorageObserver` as a
:class:`StorageOp`: the API process's observer updates Prometheus metrics directly, the
worker's buffers the ops for its next completion message (see ``service.engine.writer``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from service.storage.base import (
    Data,
    ObjectPage,
    ObjectReader,
    ObjectRef,
    Storage,
    StorageError,
    StorageObserver,
    StorageOp,
    StoreUsage,
    Swept,
)


class InstrumentedStorage(Storage):
    """Delegates to ``inner`` and reports every call to ``observer``."""

    def __init__(self, inner: Storage, observer: StorageObserver) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        self.container = inner.container
        self.expires = inner.expires
        self._observer = observer
        self._lock = threading.Lock()
        self._retries_seen = inner.retries

    def _new_retries(self) -> int:
        """Retries since the last report; concurrent calls may swap them, the sum holds."""
        with self._lock:
            total = self.inner.retries
            new, self._retries_seen = total - self._retries_seen, total
        return new

    def _report(
        self,
        operation: str,
        start: float,
        *,
        written: int = 0,
        read: int = 0,
        error: str | None = None,
    ) -> None:
        seconds = time.perf_counter() - start
        retries = self._new_retries()
        op = StorageOp(self.scheme, operation, seconds, written, read, error, retries)
        self._observer.observe(op)

    @asynccontextmanager
    async def _observe(self, operation: str) -> AsyncIterator[dict[str, int]]:
        """Times the block; the block may set ``written`` / ``read`` in the yielded dict."""
        start, counts = time.perf_counter(), {"written": 0, "read": 0}
        try:
            yield counts
        except StorageError as exc:
            self._report(operation, start, error=exc.kind)
            raise
        except Exception:
            self._report(operation, start, error="internal")
            raise
        self._report(operation, start, written=counts["written"], read=counts["read"])

    def uri(self, key: str) -> str:
        return self.inner.uri(key)

    @property
    def retries(self) -> int:
        return self.inner.retries

    def presigned_url(self, key: str) -> str | None:
        return self.inner.presigned_url(key)

    def usage(self) -> StoreUsage | None:
        return self.inner.usage()

    async def put(self, key: str, data: Data, *, expires_at: int | None = None) -> ObjectRef:
        async with self._observe("put") as counts:
            # Only an expiring put names the argument, so a backend plugged in by a
            # factory (``storage_factory``) before expiry existed still takes the others.
            expiry = {} if expires_at is None else {"expires_at": expires_at}
            ref = await self.inner.put(key, data, **expiry)
            counts["written"] = ref.size
        return ref

    async def get(self, key: str) -> bytes:
        async with self._observe("get") as counts:
            data = await self.inner.get(key)
            counts["read"] = len(data)
        return data

    async def open_read(self, key: str) -> ObjectReader:
        """One ``get`` op, timed from the open to the last piece handed over."""
        start = time.perf_counter()
        try:
            reader = await self.inner.open_read(key)
        except StorageError as exc:
            self._report("get", start, error=exc.kind)
            raise
        return ObjectReader(reader.size, self._counted(reader.chunks, start))

    async def _counted(self, chunks: AsyncIterator[bytes], start: float) -> AsyncIterator[bytes]:
        read, error = 0, None
        try:
            async for piece in chunks:
                read += len(piece)
                yield piece
        except StorageError as exc:
            error = exc.kind
            raise
        finally:
            self._report("get", start, read=read, error=error)

    async def head(self, key: str) -> ObjectRef:
        async with self._observe("head"):
            return await self.inner.head(key)

    async def exists(self, key: str) -> bool:
        async with self._observe("exists"):
            return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        async with self._observe("delete"):
            await self.inner.delete(key)

    async def delete_many(self, keys: Sequence[str]) -> None:
        """One ``delete`` op for the whole batch."""
        async with self._observe("delete"):
            await self.inner.delete_many(keys)

    async def clean(self) -> Swept:
        """Not an op: the sweeper counts what it removed (``hsx_storage_swept_objects``)."""
        return await self.inner.clean()

    async def ping(self) -> None:
        async with self._observe("ping"):
            await self.inner.ping()

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        async with self._observe("list"):
            return await self.inner.list(prefix, limit=limit, after=after)

    async def close(self) -> None:
        await self.inner.close()
