"""The OpenAI routes under /extract's rules: overload, deadline, disconnect, storage failure.

Overload is refused before the engine, so it runs on the fake; the rest needs the
engine's own aborts and writer (marked).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import AUTH_A, AUTH_FLAKY, KEYS, ServerThread, fast_settings, objects_under
from tests.api.fake import fake_extractor, fake_server
from tests.api.openai_helpers import wait_until_idle
from tests.engine.conftest import random_prompts


def test_overload_is_429_with_retry_after(tmp_path: Path, tokenizer_dir: Path) -> None:
    fake = fake_extractor(tmp_path / "objects", tokenizer_dir)
    settings = fast_settings(tmp_path, max_queued_prompts=1)
    with fake_server(settings, fake, KEYS) as server:
        overloaded(server.url, lambda: float(fake.submitted))


def overloaded(url: str, engine_requests: Callable[[], float]) -> None:
    engine = engine_requests()
    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 1},
        headers=AUTH_A,
        timeout=60,
    )
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"] == {
        "message": "too much work queued; retry later",
        "type": "overloaded",
        "param": None,
        "code": 429,
    }
    assert engine_requests() == engine
    ok = httpx.post(
        f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers=AUTH_A
    )
    assert ok.status_code == 200


@pytest.mark.engine
@pytest.mark.slow
def test_deadline_is_504_and_leaves_nothing(local_engine: ServerThread) -> None:
    url = local_engine.serve(request_timeout_s=0.05)
    before = objects_under(local_engine.root, "team-a")  # type: ignore[attr-defined]
    body = {"prompt": random_prompts([100] * 2, seed=51), "max_tokens": 64}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH_A, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    wait_until_idle(local_engine)
    time.sleep(0.3)  # a late object of an aborted request is deleted on arrival
    assert objects_under(local_engine.root, "team-a") == before  # type: ignore[attr-defined]


@pytest.mark.engine
@pytest.mark.slow
def test_disconnect_aborts_the_engine_requests(local_engine: ServerThread) -> None:
    # 32 prompts of 200 tokens through a 64-token prefill budget, then up to 256 tokens
    # each: seconds of work on any machine, so the 1 s read timeout always comes first
    # and the engine is still busy when the client goes.
    url = local_engine.serve(max_prompts=32, max_total_tokens=20000, max_tokens=256)
    before = objects_under(local_engine.root, "team-a")  # type: ignore[attr-defined]
    body = {"prompt": random_prompts([200] * 32, seed=53), "max_tokens": 256}
    with (
        httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=1.0)) as short,
        pytest.raises(httpx.ReadTimeout),
    ):
        short.post("/v1/completions", json=body, headers=AUTH_A)
    assert wait_until_idle(local_engine) < 2.0
    time.sleep(0.3)
    assert objects_under(local_engine.root, "team-a") == before  # type: ignore[attr-defined]


@pytest.mark.engine
@pytest.mark.slow
def test_storage_failure_is_502_without_keys_for_lost_objects(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    lengths = [4, 5, 6, 7]  # odd token counts fail in the "flaky" namespace
    body = {"prompt": random_prompts(lengths, seed=52), "max_tokens": 1}
    before = objects_under(local_engine.root, "flaky-team")  # type: ignore[attr-defined]
    response = client.post("/v1/completions", json=body, headers=AUTH_FLAKY)
    assert response.status_code == 502
    data = response.json()
    assert data["error"]["type"] == "storage_error"
    assert data["error"]["code"] == 502
    assert "kv_transfer_params" not in data
    stored = objects_under(local_engine.root, "flaky-team") - before  # type: ignore[attr-defined]
    for outcome, length in zip(data["objects"], lengths, strict=True):
        if length % 2:
            assert "key" not in outcome
            # The client hears what failed, never the detail (paths, buckets: server log).
            assert outcome["error"]["type"] == "storage_error"
            assert "injected" not in outcome["error"]["message"]
        else:
            assert outcome["key"] in stored  # durable, and listed so it can be deleted
    assert stored == {o["key"] for o in data["objects"] if "key" in o}
