"""A test double of the extractor, behind the API's protocol (service.api.extractor).

Everything but the engine is real: the tokenizer is the tiny model's Hugging Face
tokenizer, the OpenAI routes' front end is vLLM's own renderer built without an engine
(``VllmFrontEnd.without_engine``, as vLLM's GPU-less render server builds it), objects
are real safetensors files written through the real local storage.
Faults the real engine cannot produce on demand are injected per prompt length
(``faults``), and ``gate`` holds chosen prompts in flight until the test opens it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from fastapi import FastAPI
from safetensors.numpy import save

from service import codecs
from service.api.app import create_app
from service.api.auth import ApiKeys
from service.config import Settings
from service.engine.builder import served_model_name
from service.engine.errors import (
    EngineUnavailableError,
    InvalidPromptError,
    InvalidStatesError,
    StorageWriteError,
)
from service.engine.front_end import VllmFrontEnd
from service.engine.metrics import ExtractorMetrics
from service.engine.objects import object_metadata
from service.engine.provenance import Provenance, build_provenance
from service.engine.statistics import layer_statistics
from service.engine.wire import Extraction, Generated, RequestParams, Sampling
from service.storage.base import AlreadyExistsError
from service.storage.expiry import expires_at
from service.storage.local import LocalStorage

__all__ = [
    "EngineUnavailableError",
    "FakeExtractor",
    "InvalidPromptError",
    "InvalidStatesError",
    "StorageWriteError",
]


@dataclass(frozen=True)
class FakeModelInfo:
    name: str
    hidden_size: int = 8
    vocab_size: int = 512
    num_layers: int = 4


@dataclass
class FakeExtractor:
    """Writes one small real object per prompt; ``submitted`` counts engine requests."""

    storage: LocalStorage
    tokenizer: Any
    info: FakeModelInfo
    layer_ids: list[int] = field(default_factory=lambda: [1, 2, 4])
    dtype: str = "float32"
    max_model_len: int = 512
    alive: bool = True
    submitted: int = 0
    #: Prompt length -> exception class raised for prompts of that length.
    faults: dict[int, type[Exception]] = field(default_factory=dict)
    #: Prompt lengths held until ``gate`` is set (others finish at once).
    held: set[int] = field(default_factory=set)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    #: How many prompts are waiting at the gate right now.
    waiting: int = 0
    metrics: ExtractorMetrics = field(default_factory=lambda: ExtractorMetrics("file"))
    #: Keys of every object written so far (some may have been removed since).
    written: list[str] = field(default_factory=list)
    closed: bool = False
    #: The server default codec (``storage.codec``).
    default_codec: str = "raw"
    provenance: Provenance = field(
        default_factory=lambda: Provenance(hsx_version="0", vllm_version="0", torch_version="0")
    )

    @property
    def codecs(self) -> list[str]:
        return list(codecs.offered(self.dtype))

    def check_codec(self, codec: str | None) -> str:
        return codecs.check_codec(codec or self.default_codec, self.dtype)

    def check_layers(self, layers: Sequence[int] | None) -> None:
        codecs.check_layers(layers, self.layer_ids)

    @property
    def front_end(self) -> VllmFrontEnd:
        """vLLM's front end on the tiny model's config and tokenizer, without an engine."""
        return _front_end(self.info.name, self.max_model_len)

    async def extract(
        self, prompt_token_ids: Sequence[int], params: RequestParams, *, max_tokens: int = 1
    ) -> Extraction:
        self.submitted += 1
        ids = list(prompt_token_ids)
        if not self.alive:
            raise EngineUnavailableError("engine is dead")
        if len(ids) in self.held:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        fault = self.faults.get(len(ids))
        if fault is InvalidPromptError:  # vLLM's words: about the prompt only
            raise fault(f"the prompt ({len(ids)} tokens) is longer than the model allows")
        if fault is InvalidStatesError:  # the writer's check: nothing was stored
            raise fault(f"layer 2 of prompt ({len(ids)} tokens) is all zeros", "all_zero_layer")
        if fault is not None:  # a storage error's detail names paths, buckets, endpoints
            raise fault(f"injected failure for {self.storage.root}/{params.key}")
        layer_ids = tuple(self.layer_ids) if params.layers is None else params.layers
        states = np.zeros((len(ids), len(layer_ids), self.info.hidden_size), np.float32)
        # The real scheduler's metadata (provenance included), so both write the same keys.
        provenance = self.provenance.metadata(params.codec, self.dtype)
        metadata = object_metadata(
            self.info.name, layer_ids, self.dtype, params.metadata, provenance
        )
        data = save({"hidden_states": states, "token_ids": np.asarray(ids, np.int64)}, metadata)
        try:
            ref = await self.storage.put(params.key, data, expires_at=expires_at(params.ttl_s))
        except AlreadyExistsError as exc:  # as the real writer reports a lost create-only race
            raise StorageWriteError(f"object exists: {exc}") from exc
        self.written.append(ref.key)
        return Extraction(
            key=ref.key,
            uri=ref.uri,
            size=ref.size,
            sha256=ref.sha256,
            num_tokens=len(ids),
            shape=tuple(states.shape),
            layer_ids=layer_ids,
            statistics=layer_statistics(torch.from_numpy(states)),
            prompt_tokens=len(ids),
            output_token_ids=tuple([3] * max_tokens),
            codec=params.codec,
        )

    #: Plain generations (regeneration's turns) so far.
    generations: int = 0
    #: The fake's "prefix cache" block size (``prefix_block_size``).
    prefix_block_size: int | None = 16

    async def generate(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> Generated:
        """A deterministic answer: up to four tokens drawn from the prompt and the seed,
        then the tokenizer's end-of-sequence token when there is room (``stop``)."""
        self.generations += 1
        if not self.alive:
            raise EngineUnavailableError("engine is dead")
        base = sum(prompt_token_ids) + (sampling.seed or 0) * int(sampling.temperature > 0)
        tokens = [10 + (base + 7 * i) % 200 for i in range(min(4, sampling.max_tokens))]
        if sampling.max_tokens > 4:
            tokens.append(int(self.tokenizer.eos_token_id))
            return Generated(token_ids=tuple(tokens), finish_reason="stop")
        return Generated(token_ids=tuple(tokens), finish_reason="length")

    async def on_workers(self, method: str) -> list[Any]:
        """No workers: no KV layout, no memory samples."""
        return []

    async def close(self) -> None:
        self.closed = True
        await self.storage.close()


@functools.cache
def _front_end(model: str, max_model_len: int) -> VllmFrontEnd:
    """One per model and process: building vLLM's model config takes seconds."""
    return VllmFrontEnd.without_engine(model, served_model_name(model), max_model_len=max_model_len)


def fake_extractor(root: Path, model: Path, **options: Any) -> FakeExtractor:
    """A fake over real local storage at ``root`` and ``model``'s real tokenizer."""
    from transformers import AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    storage = LocalStorage(root, fsync=False)
    tokenizer = AutoTokenizer.from_pretrained(model)
    options.setdefault("provenance", _provenance(str(model)))
    return FakeExtractor(storage, tokenizer, FakeModelInfo(str(model)), **options)


@functools.cache
def _provenance(model: str) -> Provenance:
    """The tiny model's real provenance (no weights: no weights hash), once per process."""
    from transformers import AutoTokenizer

    return build_provenance(model, tokenizer=AutoTokenizer.from_pretrained(model))


@contextlib.asynccontextmanager
async def serving_in_process(
    settings: Settings, extractor: FakeExtractor, keys: ApiKeys
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan run, and a client speaking ASGI to it (no sockets)."""
    app = create_app(settings, extractor=extractor, keys=keys)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hsx") as client:
            yield app, client


def list_objects(root: Path, namespace: str) -> set[str]:
    base = root / "hsx" / namespace
    if not base.exists():
        return set()
    return {str(p.relative_to(root)) for p in base.rglob("*.safetensors")}


class FakeServer:
    """A real uvicorn on 127.0.0.1 (with hsx's connection bounds) around the fake, in a
    thread with its own event loop: for what only a socket shows (timeouts, disconnects)."""

    def __init__(self, settings: Settings, extractor: FakeExtractor, keys: ApiKeys) -> None:
        import socket
        import threading

        import uvicorn

        from service.api.connections import uvicorn_options

        self.extractor = extractor
        self.app = create_app(settings, extractor=extractor, keys=keys)
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self.app, log_level="warning", **uvicorn_options(settings))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.host, self.port = self.sock.getsockname()
        self.url = f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def wait_started(self, limit_s: float = 30) -> None:
        import time

        deadline = time.monotonic() + limit_s
        while not self.server.started:
            assert self.thread.is_alive(), "server died at start"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` in the server's loop (e.g. to open the fake's gate)."""
        import concurrent.futures

        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(lambda: done.set_result(fn()))
        return done.result(10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def fake_server(
    settings: Settings, extractor: FakeExtractor, keys: ApiKeys
) -> Iterator[FakeServer]:
    server = FakeServer(settings, extractor, keys)
    try:
        server.wait_started()
        yield server
    finally:
        server.stop()
