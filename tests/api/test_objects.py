"""Reading and deleting objects at once, and readiness for writes. Fast (fake extractor,
real local storage)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tests.api.conftest import AUTH_A, KEYS, fast_settings
from tests.api.fake import serving_in_process


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
