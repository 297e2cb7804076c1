"""Reading and deleting objects at once, and readiness for writes. Fast (fake extractor,
real local storage)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.storage.keys import new_object_key
from tests.api.conftest import AUTH_A, AUTH_B, KEYS, fast_settings
from tests.api.fake import list_objects, serving_in_process
from tests.codecs.test_codecs import CORRUPT


async def test_get_racing_delete_is_whole_or_404(app_client: httpx.AsyncClient, fake: Any) -> None:
    body = {"prompts": [{"token_ids": [5] * 500}]}  # about 48 KB per object
    outcomes = set()
    for _ in range(40):
        key = (await app_client.post("/extract", json=body, headers=AUTH_A)).json()["objects"][0][
            "key"
        ]
        whole = (fake.storage.root / key).read_bytes()
        got, deleted = await asyncio.gather(
            app_client.get(f"/objects/{key}", headers=AUTH_A),
            app_client.delete(f"/objects/{key}", headers=AUTH_A),
        )
        assert deleted.status_code == 204
        assert got.status_code in (200, 404), got.text
        if got.status_code == 200:
            assert got.content == whole
            assert got.headers["content-length"] == str(len(whole))
        else:
            assert got.json()["error"]["type"] == "not_found"
        outcomes.add(got.status_code)
    assert not (fake.storage.root / "hsx" / "team-a").exists() or not any(
        (fake.storage.root / "hsx" / "team-a").rglob("*.safetensors")
    )


async def test_ready_turns_503_when_free_space_is_below_the_setting(
    fake: Any, tmp_path: Path
) -> None:
    settings = fast_settings(tmp_path)
    settings.storage.local.min_free_bytes = 1 << 62  # more than any disk has
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        response = await client.get("/ready")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "detail": "storage: too little free space"}
    assert str(tmp_path) not in response.text
    async with serving_in_process(fast_settings(tmp_path), fake, KEYS) as (_, client):
        assert (await client.get("/ready")).json() == {"status": "ready"}


async def test_ready_hides_why_storage_is_unavailable(fake: Any, tmp_path: Path) -> None:
    async with serving_in_process(fast_settings(tmp_path), fake, KEYS) as (_, client):
        moved = fake.storage.root.rename(tmp_path / "elsewhere")  # the volume went away
        try:
            response = await client.get("/ready")
        finally:
            moved.rename(fake.storage.root)
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "detail": "storage: unavailable"}


async def test_listing_shows_only_what_get_serves_and_symlinks_out_are_404(
    app_client: httpx.AsyncClient, fake: Any, tmp_path: Path
) -> None:
    # Issue 26, finding 11: a stray file in the storage root was listed by GET /objects
    # and then 404 on GET; a key whose path leads out of the root through a symlink
    # answered 502 (the storage refused the key) where a missing object is a 404.
    body = {"prompts": [{"token_ids": [5, 6, 7]}, {"token_ids": [8, 9]}]}
    made = await app_client.post("/extract", json=body, headers=AUTH_A)
    keys = sorted(o["key"] for o in made.json()["objects"])
    root = fake.storage.root
    day = keys[0].rsplit("/", 1)[0]  # hsx/team-a/yyyy/mm/dd
    strays = [
        "hsx/team-a/notes.safetensors",  # a valid key, not one of this server's layout
        f"{day}/readme.txt",
        f"{day}/has space.safetensors",  # no key at all
    ]
    for name in strays:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"stray")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(b"not an object of this store")
    (root / day).parent.joinpath("99").symlink_to(outside)
    escaped = f"{day.rsplit('/', 1)[0]}/99/x.safetensors"

    for limit in (1, 2, 100):
        listed, cursor = [], None
        while True:
            query = {"limit": limit, **({"cursor": cursor} if cursor else {})}
            page = await app_client.get("/objects", params=query, headers=AUTH_A)
            assert page.status_code == 200, page.text
            listed += [o["key"] for o in page.json()["objects"]]
            cursor = page.json().get("next_cursor")
            if cursor is None:
                break
        assert listed == keys, limit
    for key in keys:  # everything listed is served
        assert (await app_client.get(f"/objects/{key}", headers=AUTH_A)).status_code == 200
    for name in [*strays, escaped]:
        for response in (
            await app_client.get(f"/objects/{name}", headers=AUTH_A),
            await app_client.get(f"/objects/{name}", params={"decode": "true"}, headers=AUTH_A),
            await app_client.delete(f"/objects/{name}", headers=AUTH_A),
        ):
            assert response.status_code == 404, (name, response.text)
            assert response.json()["error"]["type"] == "not_found"
            assert str(outside) not in response.text
    assert (outside / "x.safetensors").read_bytes() == b"not an object of this store"


@pytest.mark.parametrize("case", list(CORRUPT))
async def test_decoding_a_malformed_object_is_a_422_naming_decode(
    app_client: httpx.AsyncClient, fake: Any, case: str
) -> None:
    # Issue 26, finding 6: six shapes of corruption answered 500, a raw object with a
    # 2^62 header length 200. Every one is the same 422 now; the bytes stay readable.
    make, says = CORRUPT[case]
    data = make()
    key = new_object_key("hsx", "team-a")
    await fake.storage.put(key, data)
    decoded = await app_client.get(f"/objects/{key}", params={"decode": "true"}, headers=AUTH_A)
    assert decoded.status_code == 422, decoded.text
    error = decoded.json()["error"]
    assert (error["type"], error["field"]) == ("invalid_request", "decode")
    assert error["message"].startswith("decode: not a well-formed hidden-state object: ")
    assert says in error["message"]
    as_stored = await app_client.get(f"/objects/{key}", headers=AUTH_A)
    assert (as_stored.status_code, as_stored.content) == (200, data)


# -- DELETE /objects?prefix= (issue 29) -------------------------------------------------


async def made(client: httpx.AsyncClient, auth: dict[str, str], count: int) -> list[str]:
    body = {"prompts": [{"token_ids": [5, 6, i]} for i in range(count)]}
    response = await client.post("/extract", json=body, headers=auth)
    assert response.status_code == 200, response.text
    return sorted(o["key"] for o in response.json()["objects"])


async def test_prefix_delete_removes_exactly_the_namespaces_page(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    mine, theirs = await made(app_client, AUTH_A, 5), await made(app_client, AUTH_B, 3)
    year = mine[0].split("/")[2]  # hsx/team-a/yyyy/...
    first = await app_client.delete(f"/objects?prefix={year}/&limit=2", headers=AUTH_A)
    assert first.status_code == 200, first.text
    page = first.json()
    assert page["deleted"] == mine[:2]  # key order, one bounded page
    assert page["truncated"] is True
    assert list_objects(fake.storage.root, "team-a") == set(mine[2:])
    rest = await app_client.delete(f"/objects?prefix={year}/&limit=10", headers=AUTH_A)
    assert rest.json() == {"deleted": mine[2:], "truncated": False, "next_cursor": None}
    assert list_objects(fake.storage.root, "team-a") == set()
    assert list_objects(fake.storage.root, "team-b") == set(theirs)  # nothing else
    for key in theirs:
        assert (await app_client.get(f"/objects/{key}", headers=AUTH_B)).status_code == 200


@pytest.mark.parametrize(
    "prefix",
    [
        "",  # the whole namespace: refused, not a wildcard
        "..",
        "../team-b/",
        "2026/../../team-b/",
        "/hsx/team-b/",
        "2026//",
        "x" * 2000,  # past the key length
        "é",
        "\uff12\uff10\uff12\uff16",  # full-width digits
        "2026\u202e/",  # right-to-left override
        "2026\x00",
        "by-id/.hsx-exp-",  # sidecars and temp files are never keys
    ],
)
async def test_prefix_delete_refuses_prefixes_no_key_of_yours_can_have(
    app_client: httpx.AsyncClient, fake: Any, prefix: str
) -> None:
    mine, theirs = await made(app_client, AUTH_A, 2), await made(app_client, AUTH_B, 2)
    response = await app_client.delete("/objects", params={"prefix": prefix}, headers=AUTH_A)
    assert response.status_code == 422, response.text
    # Query-level bounds (empty, too long) are named as FastAPI names them.
    assert response.json()["error"]["field"].removeprefix("query.") == "prefix"
    assert list_objects(fake.storage.root, "team-a") == set(mine)
    assert list_objects(fake.storage.root, "team-b") == set(theirs)


async def test_another_namespaces_prefix_matches_nothing_of_theirs(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    theirs = await made(app_client, AUTH_B, 2)
    # Relative to team-a's root: hsx/team-a/hsx/team-b/..., which holds nothing.
    for prefix in ("hsx/team-b/", "team-b/", theirs[0]):
        response = await app_client.delete("/objects", params={"prefix": prefix}, headers=AUTH_A)
        assert response.status_code == 200, response.text
        assert response.json()["deleted"] == []
    assert list_objects(fake.storage.root, "team-b") == set(theirs)


async def test_prefix_delete_refuses_a_cursor_of_another_listing(
    app_client: httpx.AsyncClient,
) -> None:
    theirs = await made(app_client, AUTH_B, 1)
    cursor = base64.urlsafe_b64encode(theirs[0].encode()).decode().rstrip("=")
    response = await app_client.delete(
        "/objects", params={"prefix": "2", "cursor": cursor}, headers=AUTH_A
    )
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "cursor"
    for limit in (0, 1001):
        response = await app_client.delete(
            "/objects", params={"prefix": "2", "limit": limit}, headers=AUTH_A
        )
        assert response.status_code == 422
        assert response.json()["error"]["field"] == "query.limit"


async def test_prefix_delete_needs_a_key(app_client: httpx.AsyncClient) -> None:
    response = await app_client.delete("/objects", params={"prefix": "2"})
    assert response.status_code == 401
