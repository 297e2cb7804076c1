"""SIGTERM with long requests in flight, against the shared security server: past the
grace period they are answered 503 and only the objects a client was told of remain.

It stops the server, so it lives in a module of its own that runs after the other
security modules (file order); the server is ``conftest.py``'s.
"""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.e2e.security.harness import KEYS, LONG_LENGTHS, Server, auth, long_body, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_sigterm_past_grace_answers_503_and_leaves_only_reported_objects(server: Server) -> None:
    """It stops the server: the last security test (see the module's docstring)."""
    first = httpx.post(
        f"{server.url}/extract", json={"prompts": [{"token_ids": [5, 6]}]}, headers=auth("shut")
    )
    assert first.status_code == 200
    results: list[httpx.Response] = []

    def long_request(seed: int) -> None:
        results.append(
            httpx.post(
                f"{server.url}/extract", json=long_body(seed), headers=auth("shut"), timeout=120
            )
        )

    threads = [threading.Thread(target=long_request, args=(10 + i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    # SIGTERM once the long requests' objects start to land: the grace period ends
    # (cancelling them) long before they or their deadline could.
    wait_for(
        lambda: server.metric("hsx_extract_prompts_in_flight") >= 3 * len(LONG_LENGTHS),
        60,
        "the long requests never got in flight",
    )
    wait_for(lambda: len(server.objects("shut")) >= 2, 60, "no object of the long requests landed")
    landed = len(server.objects("shut")) - 1
    server.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    assert server.proc.wait(120) == 0
    log = server.log.read_text()
    assert "timeout graceful shutdown exceeded" in log  # the grace period did pass
    assert [r.status_code for r in results] == [503] * 3, [r.text for r in results]
    for response in results:
        assert response.json() == {
            "error": {
                "type": "unavailable",
                "message": "the server shut down before the request finished; its work was aborted",
            }
        }
    assert "Traceback" not in log
    assert "CancelledError" not in log
    debug_log = (server.root.parent / "var/log/hsx-debug.log").read_text()  # every record
    assert "Traceback" not in debug_log
    assert "Exception in ASGI application" not in debug_log
    received = {
        o["key"] for r in [first, *results] if r.status_code == 200 for o in r.json()["objects"]
    }
    assert server.objects("shut") == received
    print(f"SIGTERM: {landed}+ objects had landed; the reported one stayed, all others removed")
    assert KEYS["shut"] not in log
    assert 'POST "/extract" 503 shut ' in log  # the access log saw them
