"""A storage backend that fails or slows writes on demand, for the engine fault tests.

Loaded inside vLLM's worker through the connector's ``storage_factory`` hook. It wraps
the real backend: puts to a namespace starting with ``fail`` raise, puts to one starting
with ``flaky`` raise for objects with an odd number of tokens (so one request can have
some prompts written and others not), and every put waits
``HSX_TEST_WRITE_DELAY_S`` seconds first (read at start-up from the environment, which
the worker process inherits).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from service.config import StorageSettings
from service.storage import ObjectRef, Storage, StorageError, open_storage
from service.storage.base import ObjectPage


class FaultyStorage(Storage):
    def __init__(self, inner: Storage, delay_s: float) -> None:
        self.inner, self.delay_s, self.scheme = inner, delay_s, inner.scheme

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> ObjectRef:
        await asyncio.sleep(self.delay_s)
        namespace = key.split("/")[1]
        if namespace.startswith("fail") or (namespace.startswith("flaky") and _odd(data)):
            raise StorageError("injected write failure", operation="put", key=key)
        return await self.inner.put(key, data)

    async def put_file(self, key: str, path: Path) -> ObjectRef:
        return await self.put(key, path.read_bytes())

    def uri(self, key: str) -> str:
        return self.inner.uri(key)

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def head(self, key: str) -> ObjectRef:
        return await self.inner.head(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def ping(self) -> None:
        await self.inner.ping()

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        return await self.inner.list(prefix, limit=limit, after=after)

    async def close(self) -> None:
        await self.inner.close()


def _odd(data: bytes | bytearray | memoryview) -> bool:
    from safetensors.torch import load

    return load(bytes(data))["token_ids"].numel() % 2 == 1


def open_faulty_storage(settings: StorageSettings) -> Storage:
    return FaultyStorage(
        open_storage(settings), float(os.environ.get("HSX_TEST_WRITE_DELAY_S", "0"))
    )
