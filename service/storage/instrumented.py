"""The one metrics decorator around every storage backend.

Backends stay free of metrics code; this wrapper times each operation, counts bytes and
errors (by the error's ``kind``), and exposes the client's retries, whatever the backend.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from service.metrics import StorageMetrics
from service.storage.base import ObjectPage, ObjectRef, Storage, StorageError


class InstrumentedStorage(Storage):
    """Delegates to ``inner`` and records ``hsx_storage_*`` metrics."""

    def __init__(self, inner: Storage, metrics: StorageMetrics) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        self._metrics = metrics
        metrics.retries.add(inner)

    @asynccontextmanager
    async def _observe(self, operation: str) -> AsyncIterator[None]:
        start = time.perf_counter()
        try:
            yield
        except StorageError as exc:
            self._metrics.errors.labels(self.scheme, operation, exc.kind).inc()
            raise
        except Exception:
            self._metrics.errors.labels(self.scheme, operation, "internal").inc()
            raise
        finally:
            elapsed = time.perf_counter() - start
            self._metrics.duration.labels(self.scheme, operation).observe(elapsed)

    def uri(self, key: str) -> str:
        return self.inner.uri(key)

    @property
    def retries(self) -> int:
        return self.inner.retries

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> ObjectRef:
        async with self._observe("put"):
            ref = await self.inner.put(key, data)
        self._metrics.written.labels(self.scheme).inc(ref.size)
        return ref

    async def put_file(self, key: str, path: Path) -> ObjectRef:
        async with self._observe("put"):
            ref = await self.inner.put_file(key, path)
        self._metrics.written.labels(self.scheme).inc(ref.size)
        return ref

    async def get(self, key: str) -> bytes:
        async with self._observe("get"):
            data = await self.inner.get(key)
        self._metrics.read.labels(self.scheme).inc(len(data))
        return data

    async def head(self, key: str) -> ObjectRef:
        async with self._observe("head"):
            return await self.inner.head(key)

    async def delete(self, key: str) -> None:
        async with self._observe("delete"):
            await self.inner.delete(key)

    async def ping(self) -> None:
        async with self._observe("ping"):
            await self.inner.ping()

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        async with self._observe("list"):
            return await self.inner.list(prefix, limit=limit, after=after)

    async def close(self) -> None:
        self._metrics.retries.remove(self.inner)
        await self.inner.close()
