"""``create_app(settings)``: the FastAPI application around one extractor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
from service.api.metrics import EngineCollector, ExtractMetrics, build_info
from service.api.prompts import max_token_bytes
from service.api.routes import PUBLIC_PATHS, extract, listing, meta, objects, openai
from service.api.schemas import ErrorBody
from service.api.state import Admission, ApiState, StorageProbe
from service.config import Settings
from service.engine.builder import Prepared, served_model_name
from service.engine.introspect import capacity_of
from service.engine.metrics import ExtractorMetrics
from service.metrics import StoreCollector
from service.storage import scheme_of
from service.storage.local import root_from_url
from service.storage.sweeper import sweep_forever
from service.threads import named_pool

log = logging.getLogger(__name__)

DESCRIPTION = """Hidden states of a real model, one safetensors object per prompt.

`POST /extract` answers once every object is durable. Objects hold `hidden_states`
[num_tokens, num_layers, hidden_size] and `token_ids` [num_tokens]. Every route but
`/health`, `/ready` and `/metrics` needs `Authorization: Bearer <key>`; errors share one
shape, `{"error": {"type", "message", "field"?, "index"?}}`.
"""


@dataclass(frozen=True)
class _Edge:
    """What an app has before its engine: keys, limits, metrics (the middleware's)."""

    settings: Settings
    keys: ApiKeys
    registry: CollectorRegistry
    metrics: ExtractMetrics
    admission: Admission
    body_budget: BodyBudget
    engine_metrics: EngineCollector

    @classmethod
    def new(cls, settings: Settings, keys: ApiKeys) -> _Edge:
        limits = settings.limits
        registry = CollectorRegistry()
        admission = Admission(limits.max_queued_prompts)
        metrics = ExtractMetrics(registry, scheme_of(settings.storage.url))
        metrics.bytes_limit.set(limits.max_bytes_in_flight)
        metrics.prompts_in_flight.set_function(lambda: admission.queued)
        engine_metrics = EngineCollector()
        registry.register(engine_metrics)
        budget = BodyBudget(limits.max_body_bytes_in_flight)
        return cls(settings, keys, registry, metrics, admission, budget, engine_metrics)


def create_app(
    settings: Settings,
    *,
    extractor: ExtractorLike | None = None,
    prepared: Prepared | None = None,
    storage_factory: str | None = None,
    keys: ApiKeys | None = None,
) -> FastAPI:
    """The app. Without ``extractor`` it starts (and at shutdown closes) its own, on
    ``prepared`` (what ``hsx serve``'s start-up checks proved) when given.

    ``storage_factory`` is passed to the engine's writer (tests inject faults with it);
    ``keys`` overrides the configured API keys. The app's ``ApiState`` is built in the
    lifespan, once the extractor has started, and published as ``app.state.hsx``.
    """
    if keys is None:
        keys = ApiKeys.load(settings.server.api_keys_file, _inline_keys(settings))
    edge = _Edge.new(settings, keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = extractor is None
        if not keys.enabled:
            log.warning("hsx: no API keys configured; every caller is namespace 'default'")
        started = extractor or await _start_engine(settings, prepared, storage_factory)
        try:
            state = await build_state(edge, started)
        except BaseException:
            if owned:
                await started.close()
            raise
        app.state.hsx = state
        refresher = asyncio.create_task(refresh_memory(state), name="hsx-memory")
        sweeper = start_sweeper(state)
        try:
            yield
        finally:
            state.draining = True
            refresher.cancel()
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper  # no sweep runs on storage the extractor is closing
            await settle(state)
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
    install_error_handlers(app)
    install_middleware(app, edge)
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


def mark_draining(app: FastAPI) -> None:
    """What SIGTERM does first: ``/ready`` turns 503 and new work is refused. (Before
    the lifespan has published the state there is nothing to refuse.)"""
    state: ApiState | None = getattr(app.state, "hsx", None)
    if state is not None:
        state.draining = True


def install_middleware(app: FastAPI, edge: _Edge) -> None:
    """Outermost first: access log, key check (before any read), body bounds."""
    limits, server = edge.settings.limits, edge.settings.server

    def refused(path: str) -> None:
        if path == "/extract":
            edge.metrics.rejected("unauthorized")

    # Starlette wraps in reverse order of adding: the last added runs first.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=limits.max_body_bytes,
        timeout_s=server.body_timeout_s,
        budget=edge.body_budget,
    )
    app.add_middleware(AuthMiddleware, keys=edge.keys, public=PUBLIC_PATHS, on_refused=refused)
    app.add_middleware(AccessMiddleware)


async def _start_engine(
    settings: Settings, prepared: Prepared | None, storage_factory: str | None
) -> ExtractorLike:
    from service.engine.extractor import Extractor

    return await Extractor.start(settings, prepared, storage_factory=storage_factory)


async def settle(state: ApiState, limit_s: float = 10.0) -> None:
    """Wait (at most ``limit_s``) until no /extract request is unfinished.

    Requests that shutdown cancelled clean up first: aborting their engine requests
    and removing the objects no client was told about needs the engine still running.
    """
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.admission.idle(), limit_s)


async def build_state(edge: _Edge, extractor: ExtractorLike) -> ApiState:
    """The app's whole state around a started extractor: its metrics registered, the
    storage probe, the tokenizer pool and bounds, the model's name, the KV layout."""
    settings = edge.settings
    # Storage and writer metrics belong to the extractor (fed by both processes).
    edge.registry.register(extractor.metrics)
    edge.registry.register(StoreCollector(extractor.storage))
    local = scheme_of(settings.storage.url) == "file"
    probe = StorageProbe(
        extractor.storage,
        root=root_from_url(settings.storage.url) if local else None,
        min_free_bytes=settings.storage.local.min_free_bytes,
    )
    model_name = served_model_name(extractor.info.name)
    build_info(edge.registry, model_name)
    try:
        workers = await extractor.on_workers("hsx_kv_layout")
        # One layout per data-parallel engine: its first rank's (ranks hold the same groups).
        edge.engine_metrics.layouts = [w for w in workers if w.get("rank", 0) == 0] or workers[:1]
    except Exception:  # a user-supplied worker extension replaces ours: no layout
        log.warning("hsx: KV-cache layout unavailable", exc_info=True)
    layout = edge.engine_metrics.layout
    if layout is not None:  # a fake engine, or another extension, may have none
        capacity = capacity_of(layout)
        log.info(
            "hsx: KV cache per rank: %d tokens, %d MiB, of which the hidden-state layer "
            "(not sharded by tensor parallelism) %d MiB; %d data-parallel engine(s)",
            capacity["tokens"],
            capacity["memory_bytes"] >> 20,
            capacity["hidden_state_memory_bytes"] >> 20,
            len(edge.engine_metrics.layouts),
        )
    pool = named_pool(settings.limits.tokenizer_threads, "hsx-tokenize")
    return ApiState(
        settings=settings,
        keys=edge.keys,
        registry=edge.registry,
        admission=edge.admission,
        body_budget=edge.body_budget,
        metrics=edge.metrics,
        engine_metrics=edge.engine_metrics,
        extractor=extractor,
        probe=probe,
        storage=extractor.storage,
        tokenizer_pool=pool,
        max_token_bytes=max_token_bytes(extractor.tokenizer),
        model_name=model_name,
    )


def start_sweeper(state: ApiState) -> asyncio.Task[None]:
    """The storage sweeper (``service.storage.sweeper``), counting into the extractor's
    ``hsx_storage_swept_objects`` when its metrics are ours."""
    metrics = state.extractor.metrics
    record = metrics.storage.record_sweep if isinstance(metrics, ExtractorMetrics) else None
    interval = state.settings.storage.sweep_interval_s
    return asyncio.create_task(
        sweep_forever(state.storage, interval, record or (lambda _swept: None)),
        name="hsx-sweeper",
    )


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
