"""``create_app(settings)``: the FastAPI application around one extractor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry

import service
from service.api.auth import ApiKeys
from service.api.body_limit import BodyLimitMiddleware
from service.api.deps import caller_namespace
from service.api.errors import install_error_handlers
from service.api.metrics import ExtractMetrics, build_info
from service.api.routes import extract, meta, objects, openai
from service.api.schemas import ErrorBody
from service.api.state import Admission, ApiState, StorageProbe
from service.config import Settings
from service.metrics import StorageMetrics
from service.storage.instrumented import InstrumentedStorage

log = logging.getLogger(__name__)

DESCRIPTION = """Hidden states of a real model, one safetensors object per prompt.

`POST /extract` answers once every object is durable. Objects hold `hidden_states`
[num_tokens, num_layers, hidden_size] and `token_ids` [num_tokens]. Every route but
`/health`, `/ready` and `/metrics` needs `Authorization: Bearer <key>`; errors share one
shape, `{"error": {"type", "message", "field"?, "index"?}}`.
"""


def create_app(
    settings: Settings,
    *,
    extractor: Any = None,
    storage_factory: str | None = None,
    keys: ApiKeys | None = None,
) -> FastAPI:
    """The app. Without ``extractor`` it starts (and at shutdown closes) its own.

    ``storage_factory`` is passed to the engine's writer (tests inject faults with it);
    ``keys`` overrides the configured API keys.
    """
    if keys is None:
        keys = ApiKeys.load(settings.server.api_keys_file, _inline_keys(settings))
    state = new_state(settings, keys)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        from service.engine.extractor import Extractor

        owned = extractor is None
        if not keys.enabled:
            log.warning("hsx: no API keys configured; every caller is namespace 'default'")
        state.extractor = extractor or await Extractor.start(
            settings, storage_factory=storage_factory
        )
        await attach_engine(state)
        refresher = asyncio.create_task(refresh_memory(state), name="hsx-memory")
        try:
            yield
        finally:
            state.draining = True
            refresher.cancel()
            if owned:
                await state.extractor.close()  # drains the writer: every object lands

    app = FastAPI(
        title="hsx",
        version=service.__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_url=None,  # served by meta.openapi, behind a key
        docs_url=None,
        redoc_url=None,
    )
    app.state.hsx = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    app.include_router(meta.public)
    protected: dict[str, Any] = {
        "dependencies": [Depends(caller_namespace)],
        "responses": {401: {"model": ErrorBody, "description": "Missing or invalid API key"}},
    }
    app.include_router(meta.private, **protected)
    app.include_router(extract.router, **protected)
    app.include_router(objects.router, **protected)
    app.include_router(openai.router, **protected)
    return app


def new_state(settings: Settings, keys: ApiKeys) -> ApiState:
    """The app's state before the engine is attached: keys, limits, metrics."""
    state = ApiState(
        settings=settings,
        keys=keys,
        registry=CollectorRegistry(),
        admission=Admission(settings.limits.max_queued_prompts),
    )
    state.storage_metrics = StorageMetrics(state.registry)
    state.metrics = ExtractMetrics(state.registry, state.backend, state.storage_metrics)
    state.metrics.bytes_limit.set(settings.limits.max_bytes_in_flight)
    state.metrics.prompts_in_flight.set_function(lambda: state.admission.queued)
    state.registry.register(state.engine_metrics)
    return state


async def attach_engine(state: ApiState) -> None:
    """Wire a started extractor in: storage metrics, the probe, layout, build info."""
    import vllm

    extractor = state.extractor
    assert state.storage_metrics is not None
    storage = InstrumentedStorage(extractor.storage, state.storage_metrics)
    state.storage, state.probe = storage, StorageProbe(storage)
    build_info(state.registry, service.__version__, str(vllm.__version__), extractor.info.name)
    try:
        state.engine_metrics.layout = (await extractor.on_workers("hsx_kv_layout"))[0]
    except Exception:  # a user-supplied worker extension replaces ours: no layout
        log.warning("hsx: KV-cache layout unavailable", exc_info=True)


async def refresh_memory(state: ApiState) -> None:
    """Sample the workers' memory every ``server.metrics_interval_s``."""
    while True:
        try:
            state.engine_metrics.memory = await state.extractor.on_workers("hsx_memory")
        except Exception:  # the engine may be dead or busy; /health reports that
            log.debug("hsx: memory sample failed", exc_info=True)
        await asyncio.sleep(state.settings.server.metrics_interval_s)


def _inline_keys(settings: Settings) -> str | None:
    secret = settings.server.api_keys
    return secret.get_secret_value() if secret is not None else None
