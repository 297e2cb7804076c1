"""API keys, checked from the headers before anything else. Fast: the app around the
fake extractor. A walk over ``app.routes`` catches a route that forgets auth; unknown
paths need a key too, so routes cannot be enumerated."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from service.api.auth import ApiKeys
from service.api.routes import PUBLIC_PATHS
from tests.api.conftest import KEY_A, KEY_A2, KEYS, Served, fast_settings
from tests.api.fake import serving_in_process

A_KEY = "hsx/team-a/2026/01/01/" + "0" * 32 + ".safetensors"
WRONG = [
    {},
    {"Authorization": "Bearer wrong-key-0123456789"},
    {"Authorization": f"Basic {KEY_A}"},
    {"Authorization": f"Bearer{KEY_A}"},
]

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


#: A query a route needs to answer 2xx (a prefix delete needs a prefix).
QUERIES: dict[tuple[str, str], str] = {("DELETE", "/objects"): "?prefix=2026/"}


def body_for(path: str) -> Any:
    return BODIES.get(path, {"prompts": ["x"]})


@pytest.fixture
async def served(fake: Any, tmp_path: Path) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with serving_in_process(fast_settings(tmp_path), fake, KEYS) as pair:
        yield pair


def routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled in."""
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            path = route.path.replace("{key:path}", A_KEY)
            found += [(method, path) for method in sorted(route.methods)]
    return found


async def test_every_path_but_the_probes_needs_a_key(
    served: tuple[FastAPI, httpx.AsyncClient], fake: Any
) -> None:
    app, client = served
    served_routes = routes(app)
    assert {p for _, p in served_routes} >= {
        "/extract",
        "/openapi.json",
        "/version",
        "/v1/models",
        f"/objects/{A_KEY}",
        *BODIES,
        *PUBLIC_PATHS,
    }
    unknown = [("GET", "/nope"), ("POST", "/v1/embeddings"), ("GET", "/objects")]
    for method, path in served_routes + unknown:
        for headers in WRONG:
            response = await client.request(method, path, headers=headers, json=body_for(path))
            if path in PUBLIC_PATHS:
                assert response.status_code != 401, (method, path)
                continue
            assert response.status_code == 401, (method, path, headers)
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "unauthorized"
            assert "server" not in response.headers
    assert fake.submitted == 0


async def test_the_body_of_a_request_without_a_key_is_never_read(
    served: tuple[FastAPI, httpx.AsyncClient], fake: Any
) -> None:
    _, client = served
    read = 0

    async def body() -> Any:
        nonlocal read
        for _ in range(4):
            read += 1
            yield b'{"prompts": ["x"]}'

    response = await client.post("/extract", content=body(), headers={"Content-Length": "72"})
    assert response.status_code == 401
    assert read == 0
    assert fake.submitted == 0


@pytest.mark.parametrize("key", [KEY_A, KEY_A2], ids=["current", "rotated"])
def test_right_keys_open_every_route(fake_served: Served, key: str) -> None:
    # The fake's OpenAI routes render with vLLM's own renderer, as the engine's do.
    local_url, app = fake_served.url, fake_served.app
    for method, path in routes(app):
        response = httpx.request(
            method,
            f"{local_url}{path}{QUERIES.get((method, path), '')}",
            json=body_for(path),
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        # 404: the example key names no object (but auth let the request through).
        assert response.status_code in (200, 204, 404), (method, path, response.text)
    unknown = httpx.get(f"{local_url}/nope", headers={"Authorization": f"Bearer {key}"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found"


async def test_no_keys_means_open_in_namespace_default(fake: Any, tmp_path: Path) -> None:
    async with serving_in_process(fast_settings(tmp_path), fake, ApiKeys([])) as (_, client):
        response = await client.post("/extract", json={"prompts": [{"token_ids": [3, 4]}]})
    assert response.status_code == 200
    assert response.json()["objects"][0]["key"].startswith("hsx/default/")


def test_key_file_format(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(
        "# rotation: two keys for team-a\nteam-a:aaaaaaaaaaaaaaaa1\n\n"
        "team-a:aaaaaaaaaaaaaaaa2\n  # indented comment\nteam-b:bbbbbbbbbbbbbbbb\n"
    )
    keys = ApiKeys.load(path, "team-c:cccccccccccccccc, team-d:dddddddddddddddd")
    assert keys.count == 5
    assert keys.namespace_for("aaaaaaaaaaaaaaaa2") == "team-a"
    assert keys.namespace_for("cccccccccccccccc") == "team-c"
    assert keys.namespace_for("aaaaaaaaaaaaaaaa") is None


BAD_KEY_FILES = [
    ("no colon", "team-a:aaaaaaaaaaaaaaaa\nnocolon\n", ":2: expected 'namespace:key'"),
    ("bad namespace", "Team:aaaaaaaaaaaaaaaa", ":1: namespace"),
    ("short key", "team:short", ":1: key is shorter than 16 characters"),
    (
        "one key, two namespaces",
        "team-a:aaaaaaaaaaaaaaaa\nteam-b:bbbbbbbbbbbbbbbb\nteam-b:aaaaaaaaaaaaaaaa\n",
        ":3: this key already appears at ",
    ),
    ("same line twice", "team-a:aaaaaaaaaaaaaaaa\nteam-a:aaaaaaaaaaaaaaaa\n", ":2: this key"),
    (
        "inline comment",
        "team-a:aaaaaaaaaaaaaaaa  # laptop\n",
        ":1: inline comments are not allowed",
    ),
    ("space in key", "team-a:aaaaaaaa aaaaaaaa\n", ":1: a key may hold only"),
    ("quote in key", 'team-a:"aaaaaaaaaaaaaaaa"\n', ":1: a key may hold only"),
]


@pytest.mark.parametrize(
    ("name", "text", "message"), BAD_KEY_FILES, ids=[b[0] for b in BAD_KEY_FILES]
)
def test_bad_key_files_are_refused_naming_the_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="keys") as caught:
        ApiKeys.load(path)
    assert str(caught.value).startswith(f"{path}{message.split(' ')[0]}"), caught.value
    assert message in str(caught.value)


def test_a_key_in_both_the_file_and_the_variable_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("team-a:aaaaaaaaaaaaaaaa\n")
    with pytest.raises(ValueError, match=r"HSX_SERVER__API_KEYS item 2: this key already appears"):
        ApiKeys.load(path, "team-c:cccccccccccccccc,team-b:aaaaaaaaaaaaaaaa")
