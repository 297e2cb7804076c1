"""Storage backends that fail, slow or refuse writes on demand, for the engine tests.

Loaded inside vLLM's worker (and the API process) through the ``storage_factory`` hook;
each returns a bare backend, which ``open_storage`` instruments like any other, so the
faults show in the metrics exactly as real ones would.

``open_faulty_storage`` wraps the real backend: puts to a namespace starting with
``fail`` raise, puts to one starting with ``flaky`` raise for objects with an odd
number of tokens (so one request can have some prompts written and others not), and
every put waits ``HSX_TEST_WRITE_DELAY_S`` seconds first (read at start-up from the
environment, which the worker process inherits).

``open_s3_with_503s`` is the real S3 backend whose real botocore client answers the
first attempt of every PutObject under a namespace starting with ``retry`` with a 503
SlowDown (a ``before-send`` hook, so botocore's own retry logic handles it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from botocore.awsrequest import AWSResponse

from service.config import StorageSettings
from service.engine.introspect import HsxWorkerExtension
from service.storage import (
    Data,
    ObjectPage,
    ObjectReader,
    ObjectRef,
    Storage,
    StorageError,
    Swept,
    open_backend,
)


class FaultyStorage(Storage):
    def __init__(self, inner: Storage, delay_s: float) -> None:
        self.inner, self.delay_s, self.scheme = inner, delay_s, inner.scheme

    async def put(self, key: str, data: Data, *, expires_at: int | None = None) -> ObjectRef:
        await asyncio.sleep(self.delay_s)
        namespace = key.split("/")[1]
        if namespace.startswith("fail") or (namespace.startswith("flaky") and _odd(data)):
            raise StorageError("injected write failure", operation="put", key=key)
        return await self.inner.put(key, data, expires_at=expires_at)

    def uri(self, key: str) -> str:
        return self.inner.uri(key)

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def open_read(self, key: str) -> ObjectReader:
        return await self.inner.open_read(key)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def head(self, key: str) -> ObjectRef:
        return await self.inner.head(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def ping(self) -> None:
        await self.inner.ping()

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        return await self.inner.list(prefix, limit=limit, after=after)

    async def clean(self) -> Swept:
        return await self.inner.clean()

    async def close(self) -> None:
        await self.inner.close()


def _odd(data: Data) -> bool:
    from safetensors.torch import load

    whole = data if isinstance(data, bytes | bytearray | memoryview) else b"".join(data)
    return load(bytes(whole))["token_ids"].numel() % 2 == 1


def open_faulty_storage(settings: StorageSettings) -> Storage:
    return FaultyStorage(
        open_backend(settings), float(os.environ.get("HSX_TEST_WRITE_DELAY_S", "0"))
    )


class FirstAttempt503:
    """``before-send`` hook: a 503 SlowDown for the first attempt of each matching URL."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, request: Any, **_kwargs: Any) -> AWSResponse | None:
        if self.marker not in request.url:
            return None
        with self._lock:
            if request.url in self._seen:
                return None
            self._seen.add(request.url)
        body = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
        return AWSResponse(request.url, 503, {}, _Raw(body))


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_kwargs: Any) -> Any:
        yield self._body


def open_s3_with_503s(settings: StorageSettings) -> Storage:
    from service.storage.s3 import S3Storage

    backend = open_backend(settings)
    assert isinstance(backend, S3Storage)
    hook = FirstAttempt503(f"/{settings.key_prefix}/retry")
    backend.client.meta.events.register("before-send.s3.PutObject", hook)
    return backend


#: The embedding row ``zeroed_copy`` zeroes; random test prompts never use it.
ZERO_TOKEN = 2


def zeroed_copy(model: Path, out: Path) -> Path:
    """A copy of a tiny Llama whose embedding row ``ZERO_TOKEN`` is zeros: a broken
    checkpoint, so the real engine itself produces all-zero layers for a prompt of only
    that token (no biases: every layer stays zero). Every other row is untouched, so
    other prompts' states equal the original model's."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        return out
    shutil.copytree(model, out)
    weights = load_file(str(out / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    embedding[ZERO_TOKEN] = torch.zeros_like(embedding[ZERO_TOKEN])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class CorruptingWorkerExtension(HsxWorkerExtension):
    """hsx's worker extension plus a switch that puts a NaN into the copied-out states of
    prompts under namespaces starting with ``nan`` (what vLLM's NaN bugs delivered).

    A NaN made by the model itself (a NaN embedding row) would also sit in the
    attention KV cache, and vLLM's CPU attention then spread it to later requests that
    reuse those blocks (seen here: a 7-token prompt turned NaN); validation caught
    them, but "other prompts untouched" could not be checked. So the fault is injected
    after the copy-out, in the worker, where the real validation runs next.
    """

    def hsx_test_corrupt_states(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()._worker
        if worker is None:
            return
        copy_out = worker._copy_out

        def corrupted(save: Any, nbytes: int) -> Any:
            job = copy_out(save, nbytes)
            if save.key.split("/")[1].startswith("nan"):
                job.copy.wait()
                states = job.copy.states.clone()
                states[-1, 0, 0] = float("nan")
                tensors = {**job.copy.tensors, "hidden_states": states}
                job = replace(job, copy=replace(job.copy, tensors=tensors))
            return job

        worker._copy_out = corrupted
