"""Failures over HTTP: the failure table, admission, deadlines, shutdown, and the one
engine-backed case (a storage failure inside the real worker).

Fast tests drive the app around the fake extractor, which fails chosen prompts and
holds others in flight; every object it writes is a real file, so "nothing left
behind" is checked on disk.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import AUTH_A, AUTH_FLAKY, KEYS, ServerThread, fast_settings, objects_under
from tests.api.fake import (
    EngineUnavailableError,
    InvalidPromptError,
    InvalidStatesError,
    StorageWriteError,
    list_objects,
    serving_in_process,
)
from tests.engine.conftest import random_prompts


def prompts(*lengths: int) -> dict[str, Any]:
    return {"prompts": [{"token_ids": [5] * n} for n in lengths]}


async def test_partial_storage_failure_is_502_and_keeps_written_keys(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    fake.faults = {5: StorageWriteError, 7: StorageWriteError}
    response = await app_client.post("/extract", json=prompts(4, 5, 6, 7), headers=AUTH_A)
    assert response.status_code == 502
    data = response.json()
    assert data["error"]["type"] == "storage_error"
    assert data["error"]["index"] == 1
    outcomes = data["objects"]
    assert [o["index"] for o in outcomes] == [0, 1, 2, 3]
    assert [o.get("error", {}).get("type") for o in outcomes] == [
        None,
        "storage_error",
        None,
        "storage_error",
    ]
    # The failure's detail (here the storage root) stays in the server's log.
    assert str(fake.storage.root) not in response.text
    assert outcomes[1]["error"]["message"] == "storage: the object could not be written"
    # Exactly the reported objects exist.
    stored = list_objects(fake.storage.root, "team-a")
    assert stored == {o["key"] for o in outcomes if "key" in o}
    assert len(stored) == 2


FAILURE_TABLE = [
    # (injected per-prompt failures, status, type)
    ({5: EngineUnavailableError}, 503, "engine_unavailable"),
    ({5: EngineUnavailableError, 6: StorageWriteError}, 503, "engine_unavailable"),
    ({5: InvalidPromptError}, 422, "invalid_request"),
    ({5: InvalidPromptError, 6: StorageWriteError}, 502, "storage_error"),
    ({5: InvalidStatesError}, 500, "invalid_hidden_states"),
    ({5: InvalidStatesError, 6: InvalidPromptError}, 500, "invalid_hidden_states"),
    ({5: RuntimeError}, 500, "internal_error"),
]


@pytest.mark.parametrize(("faults", "status", "kind"), FAILURE_TABLE)
async def test_failure_table(
    app_client: httpx.AsyncClient,
    fake: Any,
    faults: dict[int, type[Exception]],
    status: int,
    kind: str,
) -> None:
    fake.faults = faults
    response = await app_client.post("/extract", json=prompts(4, 5, 6), headers=AUTH_A)
    assert response.status_code == status, response.text
    data = response.json()
    assert data["error"]["type"] == kind
    assert data["error"]["index"] == 1
    assert [o["index"] for o in data["objects"]] == [0, 1, 2]
    assert data["objects"][0]["key"] in fake.written
    assert str(fake.storage.root) not in response.text
    stored = list_objects(fake.storage.root, "team-a")
    assert stored == {o["key"] for o in data["objects"] if "key" in o}


async def test_dead_engine_refuses_before_submitting(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    fake.alive = False
    response = await app_client.post("/extract", json=prompts(3), headers=AUTH_A)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "unavailable"
    assert (await app_client.get("/health")).status_code == 503
    assert fake.submitted == 0


async def test_overload_gives_429_with_retry_after(fake: Any, tmp_path: Path) -> None:
    settings = fast_settings(tmp_path, max_queued_prompts=2)
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        response = await client.post("/extract", json=prompts(3, 3, 3), headers=AUTH_A)
        assert response.status_code == 429
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["type"] == "overloaded"
        assert fake.submitted == 0
        ok = await client.post("/extract", json=prompts(3, 3), headers=AUTH_A)
        assert ok.status_code == 200


async def test_deadline_gives_504_and_removes_what_had_landed(fake: Any, tmp_path: Path) -> None:
    fake.held = {9}  # prompts of 2 and 3 tokens land at once; the 9 waits past the deadline
    settings = fast_settings(tmp_path, request_timeout_s=0.5)
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        response = await client.post("/extract", json=prompts(2, 3, 9), headers=AUTH_A)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    assert len(fake.written) == 2  # they did land...
    assert list_objects(fake.storage.root, "team-a") == set()  # ...and were removed


async def test_shutdown_past_grace_answers_503_and_removes_what_had_landed(
    fake: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.held = {9}
    async with serving_in_process(fast_settings(tmp_path), fake, KEYS) as (app, client):
        request = asyncio.ensure_future(client.post("/extract", json=prompts(2, 9), headers=AUTH_A))
        while fake.waiting < 1 or not fake.written:  # one landed, the other held
            await asyncio.sleep(0.01)
        app.state.hsx.draining = True
        request.cancel()  # what uvicorn does to requests past the grace period
        response = await request
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert response.json() == {
        "error": {
            "type": "unavailable",
            "message": "the server shut down before the request finished; its work was aborted",
        }
    }
    assert len(fake.written) == 1
    assert list_objects(fake.storage.root, "team-a") == set()
    assert "Traceback" not in caplog.text


async def test_every_request_gets_one_access_log_line(
    app_client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hsx.access"):
        await app_client.post("/extract", json=prompts(3), headers=AUTH_A)
        await app_client.get("/nope", headers={"Authorization": "Bearer not-a-valid-key-12345"})
        await app_client.get("/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "hsx.access"]
    assert len(lines) == 3
    assert lines[0].startswith('POST "/extract" 200 team-a ')
    assert lines[1].startswith('GET "/nope" 401 unauthenticated ')
    assert lines[2].startswith('GET "/health" 200 unauthenticated ')
    assert all(line.endswith("s") for line in lines)
    assert not any(
        "not-a-valid-key" in line or AUTH_A["Authorization"][7:] in line for line in lines
    )


@pytest.mark.engine
@pytest.mark.slow
def test_worker_storage_failure_is_502_and_keeps_written_keys(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    """Through the real worker: odd token counts fail in the "flaky" namespace."""
    lengths = [4, 5, 6, 7]
    body = {"prompts": [{"token_ids": p} for p in random_prompts(lengths, seed=31)]}
    response = client.post("/extract", json=body, headers=AUTH_FLAKY)
    assert response.status_code == 502
    data = response.json()
    assert data["error"]["type"] == "storage_error"
    assert data["error"]["index"] == 1
    outcomes = data["objects"]
    for outcome, length in zip(outcomes, lengths, strict=True):
        if length % 2:
            assert "key" not in outcome
            assert outcome["error"]["type"] == "storage_error"
        else:
            assert "error" not in outcome
            assert (local_engine.root / outcome["key"]).is_file()  # type: ignore[attr-defined]
    stored = objects_under(local_engine.root, "flaky-team")  # type: ignore[attr-defined]
    assert stored == {o["key"] for o in outcomes if "key" in o}
    ok = client.post("/extract", json={"prompts": [{"token_ids": [1, 2]}]}, headers=AUTH_A)
    assert ok.status_code == 200
