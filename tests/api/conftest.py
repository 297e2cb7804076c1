"""Two kinds of API tests.

Engine-backed: real uvicorn servers on 127.0.0.1 around a real engine, run in a thread
of their own. The engine and the servers share one event loop in a background thread;
tests talk to them over HTTP only, with ordinary clients, exactly as users do. Several
apps (each with its own settings) can sit on one engine: an engine start costs 20 s.

Fast: the same app around ``tests.api.fake.FakeExtractor`` (real tokenizer, real local
storage, no engine), in process over ASGI or behind a real uvicorn on a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import codecs
from service.api.auth import ApiKeys
from service.config import Settings
from tests.engine.conftest import engine_settings

KEY_A = "team-a-key-0123456789"
KEY_A2 = "team-a-rotated-key-9876543210"
KEY_B = "team-b-key-0123456789"
KEY_FLAKY = "flaky-key-0123456789"
KEYS = ApiKeys(
    [("team-a", KEY_A), ("team-a", KEY_A2), ("team-b", KEY_B), ("flaky-team", KEY_FLAKY)]
)
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}

_CODECS = list(codecs.CODECS)
#: How pydantic names the codec choices in a refusal, from the registry, so that a new
#: codec changes no test but its own.
CODEC_CHOICES = ", ".join(map(repr, _CODECS[:-1])) + f" or {_CODECS[-1]!r}"
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
AUTH_FLAKY = {"Authorization": f"Bearer {KEY_FLAKY}"}


@dataclass(frozen=True)
class Served:
    """An app behind a real socket, as the OpenAI tests see it: its URL, the model name
    it answers to, and how many engine requests it has made so far."""

    url: str
    name: str
    engine_requests: Callable[[], float]
    #: Where its objects are stored (local disk).
    root: Path
    app: Any


class ServerThread:
    """An event loop thread holding one engine and any number of uvicorn servers."""

    def __init__(self, settings: Settings, storage_factory: str | None = None) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[Any] = []
        self.extractor = self.call(self._start(storage_factory), timeout=300)

    def call(self, coro: Any, timeout: float = 60) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    async def _start(self, storage_factory: str | None) -> Any:
        from service.engine.extractor import Extractor

        return await Extractor.start(self.settings, storage_factory=storage_factory)

    def serve(self, keys: ApiKeys | None = KEYS, **limits: Any) -> str:
        """Start a server for a new app on the shared engine; returns its base URL."""
        settings = self.settings.model_copy(
            update={"limits": self.settings.limits.model_copy(update=limits)}
        )
        return str(self.call(self._serve(settings, keys)))

    async def _serve(self, settings: Settings, keys: ApiKeys | None) -> str:
        import uvicorn

        from service.api.app import create_app
        from service.api.connections import uvicorn_options

        app = create_app(settings, extractor=self.extractor, keys=keys or ApiKeys([]))
        sock = socket.socket()
        # Accepted sockets inherit it; without it each response waited ~40 ms on
        # Nagle + delayed ACK (uvicorn's own sockets get it from asyncio).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        # The bounds `hsx serve` runs with (service.api.connections), a shorter grace.
        options = {**uvicorn_options(settings), "timeout_graceful_shutdown": 5}
        config = uvicorn.Config(app, log_level="warning", **options)
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        self.servers.append((server, task, app))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def unfinished(self) -> bool:
        """Whether the engine still has requests (a leak once all callers are done)."""
        return bool(self.extractor.engine.output_processor.has_unfinished_requests())

    def close(self) -> None:
        async def stop() -> None:
            for server, task, _ in self.servers:
                server.should_exit = True
                with contextlib.suppress(Exception):
                    await task
            await self.extractor.close()

        self.call(stop(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# Package scope: the engine goes when tests/api's last test is done, instead of idling
# (and polling the CPU) through every later module of the session.
@pytest.fixture(scope="package")
def local_engine(
    model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """The dense model on local disk, behind as many apps as the tests need."""
    root = tmp_path_factory.mktemp("api-objects")
    settings = engine_settings(
        model_dir("llama"),
        str(root),
        limits={
            "max_prompts": 8,
            "max_total_tokens": 1200,
            "max_tokens": 64,
            "max_body_bytes": 65536,
            "max_queued_prompts": 64,
        },
    )
    # Real local storage, except the fault rules of tests.engine.faulty (namespaces
    # "fail*" and "flaky*"), so one engine serves the failure tests too.
    thread = ServerThread(settings, storage_factory="tests.engine.faulty:open_faulty_storage")
    thread.root = root  # type: ignore[attr-defined]
    yield thread
    thread.close()


@pytest.fixture(scope="package")
def local_url(local_engine: ServerThread) -> str:
    """The default app: keys for team-a (two, rotation) and team-b."""
    return local_engine.serve()


@pytest.fixture
def client(local_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=local_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer and config, no weights: what the fast tests tokenise
    with, and what vLLM's front end renders with (``tests.api.fake``)."""
    from transformers import LlamaConfig

    from service.engine.tiny_models import make_tokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    make_tokenizer(out, 512)
    # The tiny Llama's shape (service.engine.tiny_models): vLLM reads the config only.
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    config.save_pretrained(out)
    return out


#: The engine-backed app's limits, so the fast tests see the same edges.
FAST_LIMITS = {
    "max_prompts": 8,
    "max_total_tokens": 1200,
    "max_tokens": 64,
    "max_body_bytes": 65536,
    "max_queued_prompts": 64,
}


def fast_settings(root: Path, server: dict[str, Any] | None = None, **limits: Any) -> Settings:
    """Settings of a fast app storing under ``root``."""
    return Settings(
        engine={"model": "unused"},
        storage={"url": str(root), "local": {"fsync": False, "min_free_bytes": 0}},
        limits={**FAST_LIMITS, **limits},
        server=server or {},
    )


@pytest.fixture(scope="module")
def fake_served(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The fast app (the engine-backed app's keys and limits) around the fake, behind a
    real uvicorn: what the OpenAI routes' refusals are checked against (vLLM's own
    front end renders there, without an engine)."""
    from service.engine.builder import served_model_name
    from tests.api.fake import fake_extractor, fake_server

    root = tmp_path_factory.mktemp("fake-served")
    extractor = fake_extractor(root / "objects", tokenizer_dir)
    with fake_server(fast_settings(root), extractor, KEYS) as server:
        name = served_model_name(extractor.info.name)
        count = lambda: float(extractor.submitted)  # noqa: E731 - the fake's engine requests
        yield Served(server.url, name, count, root / "objects", server.app)


@pytest.fixture
def fake_client(fake_served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_served.url, timeout=60) as c:
        yield c


@pytest.fixture
def sync_client(local_url: str) -> Any:
    """The official ``openai`` client on the engine-backed app, team-a's key."""
    import openai

    with openai.OpenAI(base_url=f"{local_url}/v1", api_key=KEY_A, max_retries=0) as c:
        yield c


@pytest.fixture
def fake(tmp_path: Path, tokenizer_dir: Path) -> Any:
    from tests.api.fake import fake_extractor

    return fake_extractor(tmp_path / "objects", tokenizer_dir)


@pytest.fixture
async def app_client(fake: Any, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A fast app (the engine-backed app's keys and limits) and an ASGI client for it."""
    from tests.api.fake import serving_in_process

    async with serving_in_process(fast_settings(tmp_path), fake, KEYS) as (_, client):
        yield client


def objects_under(root: Path, namespace: str) -> set[str]:
    base = root / "hsx" / namespace
    return (
        {str(p.relative_to(root)) for p in base.rglob("*") if p.is_file()}
        if base.exists()
        else set()
    )


def as_extraction(obj: dict[str, Any]) -> Any:
    """A response's object as ``assert_object_matches`` reads an extraction."""
    from types import SimpleNamespace

    return SimpleNamespace(shape=tuple(obj["shape"]), num_tokens=obj["num_tokens"])
