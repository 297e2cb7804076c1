"""Health, readiness, metrics, version, models and the OpenAPI document."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import prometheus_client
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool

import service
from service.api.deps import StateDep
from service.api.schemas import ModelCard, ModelList, Status, Version
from service.engine.introspect import capacity_of

public = APIRouter()
private = APIRouter()
UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"model": Status, "description": "Not serving"}
}


@public.get("/health", response_model=Status, responses=UNAVAILABLE)
async def health(state: StateDep) -> JSONResponse:
    """Liveness: 200 while the engine lives, 503 once it has died."""
    if not state.extractor.alive:
        return _status(503, "dead", "the engine is not running")
    return _status(200, "ok")


@public.get("/ready", response_model=Status, responses=UNAVAILABLE)
async def ready(state: StateDep) -> JSONResponse:
    """Readiness: engine started, storage can take a write (reachable, not full), not
    shutting down."""
    if state.draining:
        return _status(503, "draining", "shutting down")
    if not state.extractor.alive:
        return _status(503, "unavailable", "the engine is not running")
    error = await state.probe.error()
    if error is not None:
        return _status(503, "unavailable", f"storage: {error}")
    return _status(200, "ready")


@public.get(
    "/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
)
async def metrics(state: StateDep) -> Response:
    """Prometheus text: hsx's metrics and vLLM's (``vllm:*``, in the default registry)."""
    # Off the event loop: a bounded store's usage is read from its master on collect.
    text = await run_in_threadpool(_render, state.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def _render(registry: CollectorRegistry) -> bytes:
    return generate_latest(prometheus_client.REGISTRY) + generate_latest(registry)


@private.get("/version", response_model=Version)
async def version() -> Version:
    """Versions of hsx and of the vLLM it runs."""
    import vllm

    return Version(version=service.__version__, vllm=str(vllm.__version__))


@private.get("/v1/models", response_model=ModelList)
async def models(state: StateDep) -> ModelList:
    """The served model and what its objects hold."""
    extractor = state.extractor
    layout = state.engine_metrics.layout
    card = ModelCard(
        id=state.model_name,
        layer_ids=extractor.layer_ids,
        hidden_size=extractor.info.hidden_size,
        dtype=extractor.dtype,
        max_model_len=extractor.max_model_len,
        storage_backend=state.backend,
        codecs=extractor.codecs,
        default_codec=state.settings.storage.codec,
        # What every object's metadata carries (the codec there is the object's own).
        provenance=extractor.provenance.fields(state.settings.storage.codec, extractor.dtype),
        kv_cache=None if layout is None else capacity_of(layout),
    )
    # Dataset runs fingerprint these: a resume under another tokenizer is refused. The
    # template's hash was taken once at start-up, with the provenance.
    card.tokenizer_sha256 = tokenizer_sha256(extractor.tokenizer)
    card.chat_template_sha256 = extractor.provenance.chat_template_sha256
    return ModelList(data=[card])


@functools.lru_cache(maxsize=4)
def tokenizer_sha256(tokenizer: Any) -> str | None:
    """SHA-256 of the tokenizer's serialised form (None: no tokenizer)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(str(text).encode()).hexdigest()


@private.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    """The OpenAPI document (behind a key, like every non-probe route)."""
    return JSONResponse(request.app.openapi())


def _status(code: int, status: str, detail: str | None = None) -> JSONResponse:
    return JSONResponse(
        Status(status=status, detail=detail).model_dump(exclude_none=True), status_code=code
    )
