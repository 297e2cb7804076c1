"""``GET /objects``: the caller's own objects, page by page, so a run's output can be
found and cleaned up.

Pages follow ascending key order. The cursor is the last key of the previous page,
base64url-encoded; it must decode to a key under the caller's prefix, so a cursor can
neither reach into another namespace nor carry anything but a key.

Only keys ``GET /objects/{key}`` serves are listed: the storage lists valid keys only,
and entries of the caller's namespace that are not object keys of this server's layout
(a stray file someone put in the store) are skipped here, with the same check ``GET``
applies (``namespace_of``). A page may then hold fewer than ``limit`` objects; only a
missing ``next_cursor`` ends the listing.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from service.api.deps import NamespaceDep, StateDep
from service.api.errors import ApiError
from service.api.schemas import ErrorBody
from service.storage.base import InvalidKeyError, ObjectPage, Storage
from service.storage.keys import namespace_of, namespace_root, validate_key, validate_key_prefix

router = APIRouter()
MAX_LIMIT = 1000
#: Storage pages one listing page may read while skipping strays (bounded work).
MAX_ROUNDS = 8

RESPONSES: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorBody, "description": "Bad prefix, cursor or limit"},
    501: {"model": ErrorBody, "description": "This storage cannot list (mooncake://)"},
    502: {"model": ErrorBody, "description": "Storage failed"},
    503: {"model": ErrorBody, "description": "Storage unavailable"},
}


class ListedObject(BaseModel):
    """One stored object of the caller."""

    key: str
    size: int = Field(description="Bytes.")
    created: datetime = Field(description="When the object was published (UTC).")


class ObjectListing(BaseModel):
    """One page; pass ``next_cursor`` back as ``cursor`` for the next one."""

    objects: list[ListedObject]
    next_cursor: str | None = Field(None, description="Absent on the last page.")


@router.get("/objects", response_model=ObjectListing, responses=RESPONSES)
async def list_objects(
    state: StateDep,
    namespace: NamespaceDep,
    prefix: Annotated[str | None, Query(max_length=1024)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
    cursor: Annotated[str | None, Query(max_length=2048)] = None,
) -> ObjectListing:
    """List your objects whose keys start with ``prefix`` (default: all of them)."""
    key_prefix = state.settings.storage.key_prefix
    scope = checked_prefix(prefix, namespace_root(key_prefix, namespace))
    after = decode_cursor(cursor, scope)
    objects: list[ListedObject] = []
    for _ in range(MAX_ROUNDS):
        page = await page_of(state.storage, scope, limit - len(objects), after)
        objects += [
            ListedObject(key=o.key, size=o.size, created=o.created)
            for o in page.objects
            if namespace_of(o.key, key_prefix) == namespace  # what GET serves
        ]
        after = page.next_after
        if after is None or len(objects) >= limit:
            break
    return ObjectListing(objects=objects, next_cursor=encode_cursor(after))


async def page_of(storage: Storage, scope: str, limit: int, after: str | None) -> ObjectPage:
    """One page of the storage's listing; a 501 naming the backend where the store
    cannot list (Mooncake's master keeps no ordered key listing)."""
    try:
        return await storage.list(scope, limit=limit, after=after)
    except NotImplementedError as exc:
        raise ApiError(
            501, "not_implemented", f"listing: {storage.scheme}:// storage cannot list ({exc})"
        ) from None


def checked_prefix(prefix: str | None, root: str) -> str:
    """The caller's prefix, which must lie inside its namespace's keys."""
    if prefix is None:
        return root
    if not prefix.startswith(root):
        raise _invalid("prefix", f"must start with your namespace's keys, {root!r}")
    try:
        return validate_key_prefix(prefix)
    except InvalidKeyError as exc:
        raise _invalid("prefix", str(exc)) from None


def encode_cursor(key: str | None) -> str | None:
    if key is None:
        return None
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, scope: str) -> str | None:
    """The key a cursor continues after; 422 unless it is a key under ``scope``."""
    if cursor is None:
        return None
    try:
        key = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        validate_key(key)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise _invalid("cursor", "not a cursor this listing returned") from None
    if not key.startswith(scope):
        raise _invalid("cursor", "belongs to another listing (prefix or namespace)")
    return key


def _invalid(field: str, reason: str) -> ApiError:
    return ApiError(422, "invalid_request", f"{field}: {reason}", field=field)
