"""API keys on every route: a walk over ``app.routes`` catches a route that forgets auth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from service.api.auth import ApiKeys
from service.api.routes import PUBLIC_PATHS
from tests.api.conftest import KEY_A, KEY_A2, ServerThread

pytestmark = [pytest.mark.engine, pytest.mark.slow]

A_KEY = "hsx/team-a/2026/01/01/" + "0" * 32 + ".safetensors"
MESSAGES = [{"role": "user", "content": "x"}]
#: A valid body per route (default: /extract's), so a right key gets a 2xx.
BODIES: dict[str, Any] = {
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 1},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1},
    "/v1/chat/completions/render": {"messages": MESSAGES},
    "/v1/completions/render": {"prompt": "x"},
    "/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [1, 2]},
}


def body_for(path: str) -> Any:
    return BODIES.get(path, {"prompts": ["x"]})


def routes(local_engine: ServerThread) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled in."""
    _, _, app = local_engine.servers[0]
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            path = route.path.replace("{key:path}", A_KEY)
            found += [(method, path) for method in sorted(route.methods)]
    return found


def test_every_route_but_the_probes_needs_a_key(local_url: str, local_engine: ServerThread) -> None:
    served = routes(local_engine)
    assert {p for _, p in served} >= {
        "/extract",
        "/openapi.json",
        "/version",
        "/v1/models",
        f"/objects/{A_KEY}",
        *BODIES,
        *PUBLIC_PATHS,
    }
    for method, path in served:
        for headers in (
            {},
            {"Authorization": "Bearer wrong-key-0123456789"},
            {"Authorization": f"Basic {KEY_A}"},
        ):
            response = httpx.request(
                method, f"{local_url}{path}", headers=headers, json=body_for(path), timeout=60
            )
            if path in PUBLIC_PATHS:
                assert response.status_code != 401, (method, path)
            else:
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["WWW-Authenticate"] == "Bearer"
                assert response.json()["error"]["type"] == "unauthorized"


@pytest.mark.parametrize("key", [KEY_A, KEY_A2], ids=["current", "rotated"])
def test_right_keys_open_every_route(local_url: str, local_engine: ServerThread, key: str) -> None:
    for method, path in routes(local_engine):
        response = httpx.request(
            method,
            f"{local_url}{path}",
            json=body_for(path),
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        # 404: the example key names no object (but auth let the request through).
        assert response.status_code in (200, 204, 404), (method, path, response.text)


def test_no_keys_means_open_in_namespace_default(local_engine: ServerThread) -> None:
    url = local_engine.serve(keys=None)
    response = httpx.post(f"{url}/extract", json={"prompts": [{"token_ids": [3, 4]}]}, timeout=60)
    assert response.status_code == 200
    assert response.json()["objects"][0]["key"].startswith("hsx/default/")


def test_key_file_format(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(
        "# rotation: two keys for team-a\nteam-a:aaaaaaaaaaaaaaaa1\n\n"
        "team-a:aaaaaaaaaaaaaaaa2\nteam-b:bbbbbbbbbbbbbbbb\n"
    )
    keys = ApiKeys.load(path, "team-c:cccccccccccccccc, team-d:dddddddddddddddd")
    assert keys.count == 5
    assert keys.namespace_for("aaaaaaaaaaaaaaaa2") == "team-a"
    assert keys.namespace_for("cccccccccccccccc") == "team-c"
    assert keys.namespace_for("aaaaaaaaaaaaaaaa") is None
    for bad, message in [
        ("nocolon", "namespace:key"),
        ("Team:aaaaaaaaaaaaaaaa", "namespace"),
        ("team:short", "16 characters"),
    ]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            ApiKeys.load(path)
