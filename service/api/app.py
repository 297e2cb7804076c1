"""``create_app(settings)``: the FastAPI application around one extractor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry

import service
from service.api.access import AccessMiddleware
from service.api.auth import ApiKeys, AuthMiddleware
from service.api.body_limit import BodyBudget, BodyLimitMiddleware
from service.api.deps import caller_namespace
from service.api.errors import install_error_handlers
from service.api.extractor import ExtractorLike
from service.api.metrics import ExtractMetrics, build_info
from service.api.prompts import max_token_bytes
from service.api.routes import PUBLIC_PATHS, extract, listing, meta, objects, openai
from service.api.schemas import ErrorBody
from service.api.state import Admission, ApiState, StorageProbe
from service.config import Settings
from service.engine.builder import served_model_name
from service.storage.local import root_from_url

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
    extractor: ExtractorLike | None = None,
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
        owned = extractor is None
        if not keys.enabled:
            log.warning("hsx: no API keys configured; every caller is namespace 'default'")
        state.extractor = extractor or await _start_engine(settings, storage_factory)
        await attach_engine(state)
        refresher = asyncio.create_task(refresh_memory(state), name="hsx-memory")
        try:
            yield
        finally:
            state.draining = True
            refresher.cancel()
            await settle(state)
            if state.tokenizer_pool is not None:
                state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
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
    install_middleware(app, state)
    app.include_router(meta.public)
    protected: dict[str, Any] = {
        "dependencies": [Depends(caller_namespace)],
        "responses": {401: {"model": ErrorBody, "description": "Missing or invalid API key"}},
    }
    app.include_router(meta.private, **protected)
    app.include_router(extract.router, **protected)
    app.include_router(listing.router, **protected)
    app.include_router(objects.router, **protected)
    app.include_router(openai.router, **protected)
    return app


def install_middleware(app: FastAPI, state: ApiState) -> None:
    """Outermost first: access log, key check (before any read), body bounds."""
    limits, server = state.settings.limits, state.settings.server

    def refused(path: str) -> None:
        if state.metrics is not None and path == "/extract":
            state.metrics.rejected("unauthorized")

    # Starlette wraps in reverse order of adding: the last added runs first.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=limits.max_body_bytes,
        timeout_s=server.body_timeout_s,
        budget=state.body_budget,
    )
    app.add_middleware(AuthMiddleware, keys=state.keys, public=PUBLIC_PATHS, on_refused=refused)
    app.add_middleware(AccessMiddleware)


async def _start_engine(settings: Settings, storage_factory: str | None) -> ExtractorLike:
    from service.engine.extractor import Extractor

    return await Extractor.start(settings, storage_factory=storage_factory)


async def settle(state: ApiState, limit_s: float = 10.0) -> None:
    """Wait (at most ``limit_s``) until no /extract request is unfinished.

    Requests that shutdown cancelled clean up first: aborting their engine requests
    and removing the objects no client was told about needs the engine still running.
    """
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.admission.idle(), limit_s)


def new_state(settings: Settings, keys: ApiKeys) -> ApiState:
    """The app's state before the engine is attached: keys, limits, metrics."""
    state = ApiState(
        settings=settings,
        keys=keys,
        registry=CollectorRegistry(),
        admission=Admission(settings.limits.max_queued_prompts),
        body_budget=BodyBudget(settings.limits.max_body_bytes_in_flight),
    )
    state.metrics = ExtractMetrics(state.registry, state.backend)
    state.metrics.bytes_limit.set(settings.limits.max_bytes_in_flight)
    state.metrics.prompts_in_flight.set_function(lambda: state.admission.queued)
    state.registry.register(state.engine_metrics)
    return state


async def attach_engine(state: ApiState) -> None:
    """Wire a started extractor in: its metrics, the probe, tokenizer bounds, layout."""
    extractor = state.extractor
    # Storage and writer metrics belong to the extractor (fed by both processes).
    state.registry.register(extractor.metrics)
    state.storage = extractor.storage
    local = state.backend == "file"
    state.probe = StorageProbe(
        extractor.storage,
        root=root_from_url(state.settings.storage.url) if local else None,
        min_free_bytes=state.settings.storage.local.min_free_bytes,
    )
    state.model_name = served_model_name(extractor.info.name)
    build_info(state.registry, state.model_name)
    state.tokenizer_pool = ThreadPoolExecutor(
        state.settings.limits.tokenizer_threads, thread_name_prefix="hsx-tokenize"
    )
    state.max_token_bytes = max_token_bytes(extractor.tokenizer)
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
