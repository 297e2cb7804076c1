"""Objects that expire (issue 29): ``ttl_s`` and the server default, a 404 at once, the
listing, and the local sweeper with its metric. Fast: the fake extractor over real local
storage behind a real uvicorn (a thread), polled with ``wait_until``, never slept on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.storage.expiry import EXPIRES_AT_TAG, MAX_TTL_S, TTL_DAYS_TAG
from service.storage.local import expiry_records, read_expiry
from service.storage.s3 import S3Storage
from tests.api.conftest import AUTH_A, AUTH_B, KEYS, fast_settings
from tests.api.fake import FakeExtractor, fake_extractor, fake_server, serving_in_process
from tests.conftest import s3_settings
from tests.support.processes import wait_until

BODY = {"prompts": [{"token_ids": [5, 6, 7]}]}


@pytest.fixture
def extractor(tmp_path: Path, tokenizer_dir: Path) -> FakeExtractor:
    return fake_extractor(tmp_path / "objects", tokenizer_dir)


@contextlib.contextmanager
def served(tmp_path: Path, extractor: FakeExtractor, **storage: Any) -> Iterator[httpx.Client]:
    """A real server around ``extractor`` with these storage settings; team-a's client."""
    settings = fast_settings(tmp_path)
    settings.storage = settings.storage.model_copy(update=storage)
    with (
        fake_server(settings, extractor, KEYS) as server,
        httpx.Client(base_url=server.url, headers=AUTH_A, timeout=30) as client,
    ):
        yield client


def status(client: httpx.Client, key: str) -> int:
    return client.get(f"/objects/{key}").status_code


def swept(client: httpx.Client, reason: str) -> float:
    """``hsx_storage_swept_objects_total{reason}`` as /metrics shows it."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'hsx_storage_swept_objects_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no swept series for {reason}")


def test_expired_object_is_404_at_once_even_before_the_sweep(
    tmp_path: Path, extractor: FakeExtractor
) -> None:
    # The sweep runs at start-up, then not for an hour: only the expiry check hides it.
    with served(tmp_path, extractor, default_ttl_s=1, sweep_interval_s=3600) as client:
        key = client.post("/extract", json=BODY).json()["objects"][0]["key"]
        path = extractor.storage.path_for(key)
        assert read_expiry(path) is not None
        assert status(client, key) == 200
        assert [o["key"] for o in client.get("/objects").json()["objects"]] == [key]
        wait_until(lambda: status(client, key) == 404, 5, "expired object still served")
        assert client.get(f"/objects/{key}?decode=true").status_code == 404
        assert client.delete(f"/objects/{key}").status_code == 404
        assert client.get("/objects").json()["objects"] == []  # not listed either
        assert path.exists()  # its bytes wait for the sweep
        assert swept(client, "expired") == 0


def test_sweeper_removes_expired_objects_and_counts_them(
    tmp_path: Path, extractor: FakeExtractor
) -> None:
    with served(tmp_path, extractor, default_ttl_s=1, sweep_interval_s=0.1) as client:
        kept = extractor.storage.path_for(fresh_forever(extractor))
        key = client.post("/extract", json=BODY).json()["objects"][0]["key"]
        path = extractor.storage.path_for(key)
        wait_until(lambda: not path.exists(), 10, "the sweeper did not remove the object")
        assert expiry_records(path) == []
        assert status(client, key) == 404
        wait_until(lambda: swept(client, "expired") >= 1, 5, "sweep not counted")
        assert swept(client, "orphan") == 0
        assert kept.exists()  # an object without expiry is never swept


def fresh_forever(extractor: FakeExtractor) -> str:
    """An object of team-a's put with no expiry, straight through the storage."""
    import asyncio

    from service.storage.keys import new_object_key

    key = new_object_key("hsx", "team-a")
    asyncio.run(extractor.storage.put(key, b"forever"))
    return key


def test_without_a_ttl_objects_never_expire(tmp_path: Path, extractor: FakeExtractor) -> None:
    with served(tmp_path, extractor, sweep_interval_s=0.1) as client:
        key = client.post("/extract", json=BODY).json()["objects"][0]["key"]
        assert expiry_records(extractor.storage.path_for(key)) == []
        assert status(client, key) == 200


def test_a_bad_ttl_is_refused_naming_the_field(tmp_path: Path, extractor: FakeExtractor) -> None:
    with served(tmp_path, extractor) as client:
        for ttl in (0, -1, MAX_TTL_S + 1, "60", 1.5, True, None):
            response = client.post("/extract", json={**BODY, "ttl_s": ttl})
            if ttl is None:  # explicit null: the server default (here: none)
                assert response.status_code == 200, response.text
                continue
            assert response.status_code == 422, (ttl, response.text)
            assert response.json()["error"]["field"] == "ttl_s"
        assert len(extractor.written) == 1


def test_the_server_default_is_bounded_like_a_request() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    with pytest.raises(ValidationError, match="default_ttl_s"):
        Settings(storage={"default_ttl_s": MAX_TTL_S + 1})
    with pytest.raises(ValidationError, match="default_ttl_s"):
        Settings(storage={"default_ttl_s": 0})
    assert Settings().storage.default_ttl_s is None  # off by default


async def test_on_s3_the_tags_the_404_the_listing_and_prefix_delete(
    extractor: FakeExtractor, tmp_path: Path, s3_endpoint: str, s3_bucket: str, s3_admin: Any
) -> None:
    # The fake's writes go to moto through the real S3 backend: what the worker does.
    storage = s3_settings(s3_endpoint, s3_bucket)
    extractor.storage = S3Storage.from_settings(storage.url, storage)  # type: ignore[assignment]
    settings = fast_settings(tmp_path)
    settings.storage = storage.model_copy(update={"default_ttl_s": 1})
    async with serving_in_process(settings, extractor, KEYS) as (_, client):
        made = await client.post("/extract", json=BODY, headers=AUTH_A)
        key = made.json()["objects"][0]["key"]
        name = f"data/{key}"
        tags = s3_admin.get_object_tagging(Bucket=s3_bucket, Key=name)["TagSet"]
        expires = {t["Key"]: t["Value"] for t in tags}[EXPIRES_AT_TAG]
        assert {t["Key"]: t["Value"] for t in tags} == {EXPIRES_AT_TAG: expires, TTL_DAYS_TAG: "1"}
        assert (await client.get(f"/objects/{key}", headers=AUTH_A)).status_code == 307
        for _ in range(300):  # polled: the event loop must keep serving the app
            if (await client.get(f"/objects/{key}", headers=AUTH_A)).status_code == 404:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the expired S3 object is still served")
        assert time.time() >= int(expires)  # not before its time
        listed = await client.get("/objects", headers=AUTH_A)
        assert listed.json()["objects"] == []
        # S3 still holds it until a lifecycle rule acts: only hsx's check hides it.
        assert s3_admin.head_object(Bucket=s3_bucket, Key=name)["ContentLength"] > 0
        # A prefix delete removes the live objects of the caller's namespace only.
        forever = {"prompts": BODY["prompts"] * 2}
        settings.storage = storage  # the app's own settings, default TTL off: these stay
        mine = await client.post("/extract", json=forever, headers=AUTH_A)
        theirs = await client.post("/extract", json=forever, headers=AUTH_B)
        year = key.split("/")[2]
        page = await client.delete("/objects", params={"prefix": f"{year}/"}, headers=AUTH_A)
        assert page.json()["deleted"] == sorted(o["key"] for o in mine.json()["objects"])
        left = {o["Key"] for o in s3_admin.list_objects_v2(Bucket=s3_bucket)["Contents"]}
        assert left == {name} | {f"data/{o['key']}" for o in theirs.json()["objects"]}
    await extractor.storage.close()


@pytest.mark.engine
@pytest.mark.slow
def test_extract_with_ttl_s_on_the_engine_expires_then_is_swept(
    local_engine: Any, client: httpx.Client
) -> None:
    # The shared dense engine: ttl_s goes through RequestParams to the worker's writer.
    body, start = {**BODY, "ttl_s": 1}, time.time()
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    key = response.json()["objects"][0]["key"]
    path = local_engine.root / key
    expires = read_expiry(path)
    assert expires is not None
    assert start + 1 <= expires <= time.time() + 2  # counted from the worker's publish
    assert client.get(f"/objects/{key}", headers=AUTH_A).status_code == 200
    wait_until(
        lambda: client.get(f"/objects/{key}", headers=AUTH_A).status_code == 404,
        10,
        "the engine's object did not expire",
    )
    assert path.exists()
    swept = local_engine.call(local_engine.extractor.storage.clean())
    assert swept.expired >= 1
    assert not path.exists()
    assert expiry_records(path) == []
