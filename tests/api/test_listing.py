"""``GET /objects``: pagination over 1000 objects on local disk and on S3 (moto).

The app runs in process around the fake extractor (no engine: listing never touches it)
over ASGI, in front of the real storage backends; the objects are written by the same
backends /extract uses.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from service.api.auth import ApiKeys
from service.config import Settings, StorageSettings
from service.metrics import StorageMetrics
from service.storage import Storage, open_storage
from service.storage.keys import new_object_key
from tests.api.fake import fake_extractor, serving_in_process
from tests.conftest import s3_settings

KEY_LISTER = "lister-key-0123456789"
KEY_OTHER = "other-key-0123456789"
LISTER = {"Authorization": f"Bearer {KEY_LISTER}"}
OTHER = {"Authorization": f"Bearer {KEY_OTHER}"}
COUNT = 1000


@pytest.fixture(params=["file", "s3"])
def storage_settings(request: Any, tmp_path: Path) -> StorageSettings:
    if request.param == "file":
        return StorageSettings(url=str(tmp_path / "objects"))
    endpoint = request.getfixturevalue("s3_endpoint")
    return s3_settings(endpoint, request.getfixturevalue("s3_bucket"))


@pytest.fixture
async def api(
    storage_settings: StorageSettings, tokenizer_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app around an extractor whose storage is the backend under test."""
    settings = Settings(engine={"model": "unused"}, storage=storage_settings)
    backend = open_storage(storage_settings, StorageMetrics(CollectorRegistry()))
    extractor = fake_extractor(tmp_path / "unused", tokenizer_dir)
    await extractor.storage.close()
    extractor.storage = backend  # type: ignore[assignment]
    keys = ApiKeys([("lister", KEY_LISTER), ("other", KEY_OTHER)])
    async with serving_in_process(settings, extractor, keys) as (_, client):
        yield client, backend
    await backend.close()


async def populate(storage: Storage, namespace: str, count: int) -> dict[str, int]:
    """``count`` objects of distinct sizes under ``namespace``; key -> size."""
    sizes = {new_object_key("hsx", namespace): 1 + i % 97 for i in range(count)}
    limit = asyncio.Semaphore(32)

    async def put(key: str, size: int) -> None:
        async with limit:
            await storage.put(key, b"x" * size)

    await asyncio.gather(*(put(k, s) for k, s in sizes.items()))
    return sizes


async def list_pages(client: httpx.AsyncClient, headers: dict[str, str], **params: Any) -> Any:
    pages, cursor = [], None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        response = await client.get("/objects", params=query, headers=headers)
        assert response.status_code == 200, response.text
        pages.append(response.json()["objects"])
        cursor = response.json().get("next_cursor")
        if cursor is None:
            return pages


@pytest.mark.system
@pytest.mark.slow
async def test_pagination_over_1000_objects(api: tuple[httpx.AsyncClient, Any]) -> None:
    client, storage = api
    mine = await populate(storage, "lister", COUNT)
    theirs = await populate(storage, "other", 5)
    pages = await list_pages(client, LISTER, limit=128)
    assert [len(p) for p in pages] == [128] * 7 + [COUNT - 7 * 128]
    listed = [o for page in pages for o in page]
    assert [o["key"] for o in listed] == sorted(mine)
    assert all(o["size"] == mine[o["key"]] for o in listed)
    assert all(o["created"].endswith(("Z", "+00:00")) for o in listed)
    # Another namespace sees its own objects only, and none of these.
    others = [o["key"] for page in await list_pages(client, OTHER, limit=1000) for o in page]
    assert others == sorted(theirs)


async def test_prefix_narrows_and_objects_can_be_cleaned(
    api: tuple[httpx.AsyncClient, Any],
) -> None:
    client, storage = api
    mine = sorted(await populate(storage, "lister", 12))
    day = mine[0].rsplit("/", 1)[0] + "/"  # hsx/lister/yyyy/mm/dd/
    pages = await list_pages(client, LISTER, prefix=day, limit=5)
    assert [o["key"] for page in pages for o in page] == mine
    for key in mine[:4]:
        assert (await client.delete(f"/objects/{key}", headers=LISTER)).status_code == 204
    pages = await list_pages(client, LISTER, prefix=day, limit=1000)
    assert [o["key"] for page in pages for o in page] == mine[4:]


def _cursor(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"prefix": "hsx/other/"}, "prefix"),
        ({"prefix": "hsx/"}, "prefix"),
        ({"prefix": "hsx/lister/../other/"}, "prefix"),
        ({"prefix": "hsx/lister//"}, "prefix"),
        ({"cursor": "%%% not base64"}, "cursor"),
        ({"cursor": _cursor("../../etc/passwd")}, "cursor"),
        ({"cursor": _cursor("hsx/other/2026/01/01/x.safetensors")}, "cursor"),
        ({"limit": 0}, "query.limit"),
        ({"limit": 1001}, "query.limit"),
    ],
)
async def test_bad_prefix_cursor_or_limit_is_422(
    api: tuple[httpx.AsyncClient, Any], params: dict[str, Any], field: str
) -> None:
    client, _ = api
    response = await client.get("/objects", params=params, headers=LISTER)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


async def test_listing_needs_a_key(api: tuple[httpx.AsyncClient, Any]) -> None:
    client, _ = api
    assert (await client.get("/objects")).status_code == 401
