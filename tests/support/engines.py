"""Engine settings for tests that start a real vLLM engine (in process or served)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from service.config import Settings


def engine_settings(model: Path, storage_url: str, **overrides: Any) -> Settings:
    """Small engine settings for the CPU: chunked prefill forced by a 64-token budget.

    ``overrides`` are Settings fields; ``engine=`` and ``storage=`` dicts are merged
    into these defaults rather than replacing them.
    """
    engine = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 64,
        "gpu_memory_utilization": 0.5,
        "cpu_kvcache_space_gib": 1,
        "extra_args": {"enforce_eager": True},
        **overrides.pop("engine", {}),
    }
    return Settings(
        engine=engine, storage={"url": storage_url, **overrides.pop("storage", {})}, **overrides
    )


@contextlib.asynccontextmanager
async def serving(settings: Settings, extractor: Any) -> AsyncIterator[str]:
    """hsx's app around a started ``extractor``, behind a real uvicorn server on this
    event loop (127.0.0.1, a free port); yields its URL and stops it on the way out."""
    import uvicorn

    from service.api.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(settings, extractor=extractor), log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # start-up failed: raise its error here
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
