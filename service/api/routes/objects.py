"""``GET`` and ``DELETE /objects/{key}``, and ``DELETE /objects?prefix=``, only inside
the caller's namespace.

A key outside the caller's namespace is a 404, exactly like a missing one, so nobody
learns what other namespaces hold. Everything goes through the storage interface (its
optional features have defaults), so every read is counted in ``hsx_storage_*``.
An object of a store that keeps another layout (Mooncake's, ``service.packed``) is
answered as the safetensors bytes it has on every other backend.
``?decode=true`` answers any object as a ``raw`` one (model-dtype states), whatever
codec stored it; an object it cannot decode (a codec or version this server does not
know, or bytes that are not a well-formed object of their codec: ``service.codecs``
checks the header before reading a tensor and decompresses no more than the states'
shape allows) is a 422 ``invalid_request`` naming ``decode``, never a 500.

An expired object (``ttl_s``) is a 404 at once: the storage treats it as gone on every
read, before the sweeper or a lifecycle rule removes its bytes.

``DELETE /objects?prefix=`` deletes one page of the caller's objects under a prefix
relative to its namespace (``2026/11/``, ``by-id/``), never the namespace's root itself
(an empty prefix is refused: wiping a namespace takes one call per top-level prefix,
on purpose). The prefix is joined under the namespace's root and checked as a key
prefix, so ``..``, a leading ``/``, characters keys never hold and anything over the key
length are a 422 naming ``prefix``: no prefix can name another namespace's keys. Only
what ``GET /objects`` would list is deleted (the same ``namespace_of`` check), and the
answer names each deleted key; ``truncated`` says more may follow, to be deleted by the
next call (with ``cursor``, to step past entries that are not ours to delete).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import RedirectResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from service.api.deps import NamespaceDep, StateDep
from service.api.errors import ApiError
from service.api.routes.listing import decode_cursor, encode_cursor, page_of
from service.api.schemas import ErrorBody
from service.api.state import ApiState
from service.codecs import CorruptObjectError, to_raw
from service.packed import as_safetensors
from service.storage import Storage
from service.storage.base import InvalidKeyError, NotFoundError
from service.storage.keys import MAX_KEY_BYTES, namespace_of, namespace_root, validate_key_prefix

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
    if storage.container != "safetensors":
        return await unpacked(storage, key)
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


#: The most objects one ``DELETE /objects?prefix=`` removes (one storage listing page).
MAX_DELETE_PAGE = 1000


class DeletedObjects(BaseModel):
    """One page of a prefix delete."""

    deleted: list[str] = Field(description="The keys deleted, in key order.")
    truncated: bool = Field(description="More objects may remain under the prefix.")
    next_cursor: str | None = Field(
        None, description="Pass back as `cursor` to continue past this page; absent at the end."
    )


@router.delete(
    "/objects",
    response_model=DeletedObjects,
    responses={
        422: {"model": ErrorBody, "description": "Bad prefix, cursor or limit"},
        501: {"model": ErrorBody, "description": "This storage cannot list (mooncake://)"},
        502: {"model": ErrorBody, "description": "Storage failed"},
        503: {"model": ErrorBody, "description": "Storage unavailable"},
    },
)
async def delete_prefix(
    state: StateDep,
    namespace: NamespaceDep,
    prefix: Annotated[
        str,
        Query(
            min_length=1,
            max_length=MAX_KEY_BYTES,
            description="Delete your objects whose keys, after your namespace's root "
            "(`hsx/<namespace>/`), start with this (`2026/11/`, `by-id/`).",
        ),
    ],
    limit: Annotated[int, Query(ge=1, le=MAX_DELETE_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=2048)] = None,
) -> DeletedObjects:
    """Delete one page of your objects under ``prefix``; call again while ``truncated``."""
    key_prefix = state.settings.storage.key_prefix
    scope = namespace_root(key_prefix, namespace) + prefix
    try:
        validate_key_prefix(scope)
    except InvalidKeyError as exc:
        raise ApiError(422, "invalid_request", f"prefix: {exc}", field="prefix") from None
    after = decode_cursor(cursor, scope)
    page = await page_of(state.storage, scope, limit, after)
    keys = [o.key for o in page.objects if namespace_of(o.key, key_prefix) == namespace]
    await state.storage.delete_many(keys)
    return DeletedObjects(
        deleted=keys,
        truncated=page.next_after is not None,
        next_cursor=encode_cursor(page.next_after),
    )


@router.delete("/objects/{key:path}", status_code=204, responses=NOT_FOUND, response_class=Response)
async def delete_object(key: str, state: StateDep, namespace: NamespaceDep) -> Response:
    """Remove one object."""
    storage = owned_storage(state, key, namespace)
    await ensure_exists(storage, key)
    await storage.delete(key)
    return Response(status_code=204)


async def read_whole(storage: Storage, key: str) -> bytes:
    """The object's bytes as stored; 404 if there is none."""
    try:
        return await storage.get(key)
    except NotFoundError:
        raise not_found(key) from None


async def unpacked(storage: Storage, key: str) -> Response:
    """An object of a store that lays objects out otherwise (Mooncake's packed layout)
    as the safetensors bytes it has on any other backend."""
    data = await read_whole(storage, key)
    try:
        body = await run_in_threadpool(as_safetensors, data, storage.container)
    except CorruptObjectError as exc:
        raise ApiError(422, "invalid_request", f"key: {exc}", field="key") from None
    filename = key.rsplit("/", 1)[-1]
    headers = {"Content-Disposition": f'attachment; filename="{filename}"'}
    return Response(body, media_type=SAFETENSORS, headers=headers)


async def decoded(storage: Storage, key: str) -> Response:
    """The object as a ``raw`` one, read whole and decoded off the event loop."""
    data = await read_whole(storage, key)
    try:
        raw = await run_in_threadpool(_to_raw, data, storage.container)
    except ValueError as exc:  # an unknown codec or version, or CorruptObjectError
        raise ApiError(422, "invalid_request", f"decode: {exc}", field="decode") from None
    return Response(raw, media_type=SAFETENSORS)


def _to_raw(data: bytes, container: str) -> bytes:
    return to_raw(as_safetensors(data, container))


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
