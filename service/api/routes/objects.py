"""``GET`` and ``DELETE /objects/{key}``, only inside the caller's namespace.

A key outside the caller's namespace is a 404, exactly like a missing one, so nobody
learns what other namespaces hold. Everything goes through the storage interface (its
optional features have defaults), so every read is counted in ``hsx_storage_*``.
``?decode=true`` answers any object as a ``raw`` one (model-dtype states), whatever
codec stored it; an object it cannot decode (a codec or version this server does not
know, or bytes that are not a well-formed object of their codec: ``service.codecs``
checks the header before reading a tensor and decompresses no more than the states'
shape allows) is a 422 ``invalid_request`` naming ``decode``, never a 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import RedirectResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import NamespaceDep, StateDep
from service.api.errors import ApiError
from service.api.schemas import ErrorBody
from service.api.state import ApiState
from service.codecs import to_raw
from service.storage import Storage
from service.storage.base import NotFoundError
from service.storage.keys import namespace_of

router = APIRouter()
SAFETENSORS = "application/octet-stream"
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such object (or not in your namespace)"},
    422: {"model": ErrorBody, "description": "Invalid key, or an object `decode` cannot read"},
    502: {"model": ErrorBody, "description": "Storage failed"},
    503: {"model": ErrorBody, "description": "Storage unavailable"},
}


@router.get(
    "/objects/{key:path}",
    responses={
        200: {"content": {SAFETENSORS: {}}, "description": "The object's bytes"},
        307: {"description": "Redirect to a short-lived presigned URL (S3)"},
        **NOT_FOUND,
    },
    response_class=Response,
)
async def get_object(
    key: str,
    state: StateDep,
    namespace: NamespaceDep,
    decode: bool = Query(
        False, description="Answer a `raw` object (model-dtype states) for any codec."
    ),
) -> Response:
    """Stream an object (local disk) or redirect to a presigned URL (S3)."""
    storage = owned_storage(state, key, namespace)
    if decode:
        return await decoded(storage, key)
    url = storage.presigned_url(key)
    if url is not None:
        await ensure_exists(storage, key)
        return RedirectResponse(url, status_code=307)
    try:
        reader = await storage.open_read(key)
    except NotFoundError:
        raise not_found(key) from None
    filename = key.rsplit("/", 1)[-1]
    headers = {
        "Content-Length": str(reader.size),
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    return StreamingResponse(reader.chunks, media_type=SAFETENSORS, headers=headers)


@router.delete("/objects/{key:path}", status_code=204, responses=NOT_FOUND, response_class=Response)
async def delete_object(key: str, state: StateDep, namespace: NamespaceDep) -> Response:
    """Remove one object."""
    storage = owned_storage(state, key, namespace)
    await ensure_exists(storage, key)
    await storage.delete(key)
    return Response(status_code=204)


async def decoded(storage: Storage, key: str) -> Response:
    """The object as a ``raw`` one, read whole and decoded off the event loop."""
    try:
        data = await storage.get(key)
    except NotFoundError:
        raise not_found(key) from None
    try:
        raw = await run_in_threadpool(to_raw, data)
    except ValueError as exc:  # an unknown codec or version, or CorruptObjectError
        raise ApiError(422, "invalid_request", f"decode: {exc}", field="decode") from None
    return Response(raw, media_type=SAFETENSORS)


def owned_storage(state: ApiState, key: str, namespace: str) -> Storage:
    """The storage, once ``key`` is known to lie in the caller's namespace (else 404)."""
    if namespace_of(key, state.settings.storage.key_prefix) != namespace:
        raise not_found(key)
    return state.storage


async def ensure_exists(storage: Storage, key: str) -> None:
    """404 unless the object exists (a stat or a HEAD, never a read)."""
    if not await storage.exists(key):
        raise not_found(key)


def not_found(key: str) -> ApiError:
    return ApiError(404, "not_found", f"key: no object {key[:300]!r}", field="key")
