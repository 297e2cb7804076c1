"""``GET`` and ``DELETE /objects/{key}``, only inside the caller's namespace.

A key outside the caller's namespace is a 404, exactly like a missing one, so nobody
learns what other namespaces hold. ``?decode=true`` answers any object as a ``raw`` one
(model-dtype states), whatever codec stored it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import FileResponse, RedirectResponse
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
    422: {"model": ErrorBody, "description": "Invalid key"},
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
    owned(state, key, namespace)
    assert state.storage is not None
    backend = unwrap(state.storage)
    await ensure_exists(backend, key)
    if decode:
        return await decoded(backend, key)
    if hasattr(backend, "path_for"):
        return FileResponse(
            backend.path_for(key), media_type=SAFETENSORS, filename=key.rsplit("/", 1)[-1]
        )
    if hasattr(backend, "presign_get"):
        return RedirectResponse(backend.presign_get(key), status_code=307)
    return Response(await backend.get(key), media_type=SAFETENSORS)


@router.delete("/objects/{key:path}", status_code=204, responses=NOT_FOUND, response_class=Response)
async def delete_object(key: str, state: StateDep, namespace: NamespaceDep) -> Response:
    """Remove one object."""
    owned(state, key, namespace)
    assert state.storage is not None
    await ensure_exists(unwrap(state.storage), key)
    await state.storage.delete(key)
    return Response(status_code=204)


async def decoded(backend: Storage, key: str) -> Response:
    """The object as a ``raw`` one, decoded off the event loop."""
    try:
        data = await run_in_threadpool(to_raw, await backend.get(key))
    except ValueError as exc:  # a codec this server does not know
        raise ApiError(422, "invalid_request", f"decode: {exc}", field="decode") from None
    return Response(data, media_type=SAFETENSORS)


def owned(state: ApiState, key: str, namespace: str) -> None:
    if namespace_of(key, state.settings.storage.key_prefix) != namespace:
        raise not_found(key)


async def ensure_exists(backend: Storage, key: str) -> None:
    """404 unless the object exists (local: a stat, not head's full-file checksum)."""
    if hasattr(backend, "path_for"):
        if not backend.path_for(key).is_file():
            raise not_found(key)
        return
    try:
        await backend.head(key)
    except NotFoundError:
        raise not_found(key) from None


def not_found(key: str) -> ApiError:
    return ApiError(404, "not_found", f"key: no object {key[:300]!r}", field="key")


def unwrap(storage: Storage) -> Storage:
    """The backend under any decorator (metrics), for its backend-specific reads."""
    inner = getattr(storage, "inner", None)
    return unwrap(inner) if isinstance(inner, Storage) else storage
