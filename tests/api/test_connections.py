"""Connection bounds on a real socket (uvicorn with hsx's protocol, the fake extractor):
head size, head and body timeouts, the connection cap, the body budget, disconnects.

Timeouts are set to about a second here; every wait is for a condition, with a limit.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import AUTH_A, KEY_A, KEYS, fast_settings
from tests.api.fake import FakeServer, fake_extractor, fake_server, list_objects

SERVER = {
    "max_connections": 20,
    "max_header_bytes": 4096,
    "header_timeout_s": 1.0,
    "body_timeout_s": 1.0,
    "keep_alive_timeout_s": 1,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[FakeServer]:
    root = tmp_path_factory.mktemp("connections")
    settings = fast_settings(root, server=SERVER, max_body_bytes_in_flight=2 * 65536)
    with fake_server(settings, fake_extractor(root / "objects", tokenizer_dir), KEYS) as running:
        yield running


def connect(server: FakeServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def read_until_closed(sock: socket.socket, limit_s: float = 10) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def error_of(reply: bytes) -> dict[str, Any]:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return dict(json.loads(body)["error"])


def test_no_server_header_and_a_request_works(server: FakeServer) -> None:
    response = httpx.post(
        f"{server.url}/extract", json={"prompts": [{"token_ids": [3, 4]}]}, headers=AUTH_A
    )
    assert response.status_code == 200
    assert "server" not in response.headers


def test_head_over_the_limit_is_431_and_closed(server: FakeServer) -> None:
    with connect(server) as sock:
        replies: list[bytes] = []
        reader = threading.Thread(target=lambda: replies.append(read_until_closed(sock)))
        reader.start()
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(256):  # 16 MiB offered; the server stops after 4 KiB
                sock.sendall(b"a" * 65536)
        except OSError:
            pass  # the server closed the connection
        reader.join(10)
    assert replies[0].startswith(b"HTTP/1.1 431 "), replies[0][:200]
    assert error_of(replies[0]) == {
        "type": "headers_too_large",
        "message": "headers: the request head is larger than 4096 bytes",
        "field": "headers",
    }
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_incomplete_head_is_408_and_an_idle_connection_is_closed(server: FakeServer) -> None:
    with connect(server) as partial, connect(server) as idle:
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        reply = read_until_closed(partial)
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert error_of(reply)["type"] == "request_timeout"
        assert read_until_closed(idle) == b""  # closed without a word


def test_keep_alive_connection_is_closed_when_idle(server: FakeServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 ")  # answered, then closed after idling


def test_connections_past_the_cap_get_503_and_are_closed(server: FakeServer) -> None:
    held = [connect(server) for _ in range(SERVER["max_connections"])]
    try:
        with connect(server) as extra:
            reply = read_until_closed(extra)
        assert reply.startswith(b"HTTP/1.1 503 "), reply
        assert error_of(reply)["type"] == "unavailable"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the held ones are gone once the server notices: then all is normal
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)


def post_head(length: int, key: str | None = KEY_A) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /extract HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_slow_body_is_408_and_closed(server: FakeServer) -> None:
    with connect(server) as sock:
        sock.sendall(post_head(1000) + b'{"prompts": [')
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert error_of(reply) == {
        "type": "request_timeout",
        "message": "body: not received within 1 s",
        "field": "body",
    }


def test_bodies_past_the_budget_get_429(server: FakeServer) -> None:
    stalled = [connect(server) for _ in range(2)]  # each reserves 60,000 of 131,072 bytes
    try:
        for sock in stalled:
            sock.sendall(post_head(60000) + b"{")
        deadline = time.monotonic() + 5
        while True:
            response = httpx.post(
                f"{server.url}/extract", content=b"{" + b" " * 59998 + b"}", headers=AUTH_A
            )
            if response.status_code == 429 or time.monotonic() > deadline:
                break
        assert response.status_code == 429
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["field"] == "body"
    finally:
        for sock in stalled:
            sock.close()


def test_unauthenticated_body_is_not_read_and_the_connection_ends(server: FakeServer) -> None:
    with connect(server) as sock:
        replies: list[bytes] = []
        reader = threading.Thread(target=lambda: replies.append(read_until_closed(sock)))
        reader.start()
        sent = 0
        try:
            sock.sendall(post_head(8 * 1024 * 1024, key=None))
            for _ in range(128):  # 8 MiB, but the server stops discarding after 64 KiB
                sock.sendall(b"x" * 65536)
                sent += 65536
        except OSError:
            pass
        reader.join(10)
    assert replies[0].startswith(b"HTTP/1.1 401 "), replies[0][:200]
    assert error_of(replies[0])["type"] == "unauthorized"
    assert sent < 8 * 1024 * 1024  # the connection ended before the body did


def test_disconnect_removes_objects_that_had_landed(server: FakeServer) -> None:
    fake = server.extractor
    fake.held = {9}
    written = len(fake.written)
    body = json.dumps({"prompts": [{"token_ids": [5] * n} for n in (2, 3, 9)]}).encode()
    with connect(server) as sock:
        sock.sendall(post_head(len(body)) + body)
        deadline = time.monotonic() + 10
        while fake.waiting < 1 or len(fake.written) < written + 2:
            assert time.monotonic() < deadline  # two objects land, the third is held
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while list_objects(fake.storage.root, "team-a") & set(fake.written[written:]):
        assert time.monotonic() < deadline, "objects of the abandoned request stayed"
        time.sleep(0.02)
    server.call(fake.gate.set)


def test_head_over_the_limit_in_one_piece_is_431(
    server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hsx.access")
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert error_of(reply)["type"] == "headers_too_large"
    assert '- "-" 431 unauthenticated' in caplog.text  # its access-log line
