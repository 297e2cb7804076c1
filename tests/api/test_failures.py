"""Failures over HTTP: partial storage failures, disconnects, deadlines, overload."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from tests.api.conftest import AUTH_A, AUTH_FLAKY, ServerThread, objects_under
from tests.engine.conftest import engine_requests, random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def wait_until_idle(engine: ServerThread, limit_s: float = 10) -> float:
    """Seconds until the engine has no request left (fails past ``limit_s``)."""
    start = time.monotonic()
    while engine.unfinished():
        assert time.monotonic() - start < limit_s, "engine requests were not aborted"
        time.sleep(0.02)
    return time.monotonic() - start


def test_partial_storage_failure_is_502_and_keeps_written_keys(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    lengths = [4, 5, 6, 7]  # odd token counts fail in the "flaky" namespace
    body = {"prompts": [{"token_ids": p} for p in random_prompts(lengths, seed=31)]}
    response = client.post("/extract", json=body, headers=AUTH_FLAKY)
    assert response.status_code == 502
    data = response.json()
    assert data["error"]["type"] == "storage_error"
    assert data["error"]["index"] == 1
    outcomes = data["objects"]
    assert [o["index"] for o in outcomes] == [0, 1, 2, 3]
    for outcome, length in zip(outcomes, lengths, strict=True):
        if length % 2:
            assert "key" not in outcome
            assert outcome["error"]["type"] == "storage_error"
            assert "injected write failure" in outcome["error"]["message"]
        else:
            assert "error" not in outcome
            assert (local_engine.root / outcome["key"]).is_file()  # type: ignore[attr-defined]
    # Exactly the written objects exist: no partial object for the failed prompts.
    stored = objects_under(local_engine.root, "flaky-team")  # type: ignore[attr-defined]
    assert stored == {o["key"] for o in outcomes if "key" in o}
    # The engine keeps serving.
    ok = client.post("/extract", json={"prompts": [{"token_ids": [1, 2]}]}, headers=AUTH_A)
    assert ok.status_code == 200


def test_client_disconnect_aborts_engine_requests(
    local_url: str, local_engine: ServerThread
) -> None:
    before = objects_under(local_engine.root, "team-a")  # type: ignore[attr-defined]
    prompts = random_prompts([200] * 4, seed=32)
    # Long generations: left alone they would run for many seconds.
    body = {"prompts": [{"token_ids": p} for p in prompts], "max_tokens": 64}
    timeout = httpx.Timeout(30, read=0.2)
    with (
        httpx.Client(base_url=local_url, timeout=timeout) as short,
        pytest.raises(httpx.ReadTimeout),
    ):
        short.post("/extract", json=body, headers=AUTH_A)
    # The client is gone; its engine requests are aborted within about a second.
    assert wait_until_idle(local_engine) < 2.0
    time.sleep(0.3)
    assert objects_under(local_engine.root, "team-a") == before  # type: ignore[attr-defined]
    ok = httpx.post(
        f"{local_url}/extract",
        json={"prompts": [{"token_ids": [1, 2]}]},
        headers=AUTH_A,
        timeout=60,
    )
    assert ok.status_code == 200


def test_deadline_gives_504_and_aborts(local_engine: ServerThread) -> None:
    url = local_engine.serve(request_timeout_s=0.05)
    before = objects_under(local_engine.root, "team-a")  # type: ignore[attr-defined]
    body = {
        "prompts": [{"token_ids": p} for p in random_prompts([100] * 2, seed=33)],
        "max_tokens": 64,
    }
    response = httpx.post(f"{url}/extract", json=body, headers=AUTH_A, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    wait_until_idle(local_engine)
    time.sleep(0.3)
    assert objects_under(local_engine.root, "team-a") == before  # type: ignore[attr-defined]


def test_overload_gives_429_with_retry_after(local_engine: ServerThread) -> None:
    url = local_engine.serve(max_queued_prompts=2)
    submitted = engine_requests()
    body = {"prompts": [{"token_ids": [1, 2, 3]}] * 3}
    response = httpx.post(f"{url}/extract", json=body, headers=AUTH_A, timeout=60)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"]["type"] == "overloaded"
    assert engine_requests() == submitted
    ok = httpx.post(
        f"{url}/extract",
        json={"prompts": [{"token_ids": [1, 2, 3]}] * 2},
        headers=AUTH_A,
        timeout=60,
    )
    assert ok.status_code == 200


def read_response(sock: socket.socket) -> str:
    """Headers and the whole body (they may come in separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def test_body_over_the_limit_is_refused_while_reading(local_url: str) -> None:
    """A chunked body (no Content-Length) is cut off at the limit, not buffered whole."""
    host, port = local_url.removeprefix("http://").split(":")
    chunk = b"x" * 16384
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /extract HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {AUTH_A['Authorization'].split()[1]}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(5):  # 80 KiB > the 64 KiB limit
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        reply = read_response(sock)
    assert reply.startswith("HTTP/1.1 413")
    assert '"field":"body"' in reply
