"""Every class of bad input gets its 4xx, names the field, and never reaches the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import AUTH_A, ServerThread
from tests.engine.conftest import engine_requests

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CASES: list[tuple[str, Any, int, str, int | None]] = [
    # (name, body, status, field, index)
    ("no prompts", {"prompts": []}, 422, "prompts", None),
    ("prompts missing", {}, 422, "prompts", None),
    (
        "unknown field",
        {"prompts": ["a"], "kv_transfer_params": {"x": 1}},
        422,
        "kv_transfer_params",
        None,
    ),
    ("empty text", {"prompts": ["ok", ""]}, 422, "prompts[1]", 1),
    ("two kinds", {"prompts": [{"text": "a", "token_ids": [1]}]}, 422, "prompts[0]", 0),
    ("no kind", {"prompts": [{}]}, 422, "prompts[0]", 0),
    ("negative id", {"prompts": [{"token_ids": [1, -2]}]}, 422, "prompts[0].token_ids[1]", 0),
    ("id past vocab", {"prompts": [{"token_ids": [1, 512]}]}, 422, "prompts[0].token_ids", 0),
    ("empty ids", {"prompts": [{"token_ids": []}]}, 422, "prompts[0].token_ids", 0),
    (
        "bad role",
        {"prompts": [{"messages": [{"role": "god", "content": "x"}]}]},
        422,
        "prompts[0].messages[0].role",
        0,
    ),
    ("max_tokens 0", {"prompts": ["a"], "max_tokens": 0}, 422, "max_tokens", None),
    ("max_tokens over limit", {"prompts": ["a"], "max_tokens": 65}, 422, "max_tokens", None),
    ("too many prompts", {"prompts": ["a"] * 9}, 422, "prompts", None),
    (
        "prompt too long",
        {"prompts": [{"token_ids": [1]}, {"token_ids": [1] * 512}]},
        422,
        "prompts[1].token_ids",
        1,
    ),
    ("too many tokens", {"prompts": [{"token_ids": [1] * 500}] * 3}, 422, "prompts", 2),
    ("metadata not strings", {"prompts": ["a"], "metadata": {"k": 1}}, 422, "metadata.k", None),
    ("reserved metadata", {"prompts": ["a"], "metadata": {"model": "x"}}, 422, "", None),
    (
        "include_output_tokens type",
        {"prompts": ["a"], "include_output_tokens": "yes"},
        422,
        "include_output_tokens",
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "field", "index"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_refused_before_the_engine(
    client: httpx.Client,
    local_engine: ServerThread,
    name: str,
    body: Any,
    status: int,
    field: str,
    index: int | None,
) -> None:
    submitted = engine_requests()
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) <= {"type", "message", "field", "index"}
    assert error["message"]
    if field:
        assert error["field"] == field
        assert error["message"].startswith(field)
    assert error.get("index") == index
    assert engine_requests() == submitted


def test_malformed_json_is_422(client: httpx.Client, local_engine: ServerThread) -> None:
    submitted = engine_requests()
    response = client.post(
        "/extract", content=b'{"prompts": [', headers={**AUTH_A, "Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "invalid_request"
    assert engine_requests() == submitted


def test_declared_body_over_the_limit_is_413(client: httpx.Client) -> None:
    response = client.post(
        "/extract", content=b"x" * 70000, headers={**AUTH_A, "Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"] == {
        "type": "payload_too_large",
        "message": "body: request body is larger than 65536 bytes",
        "field": "body",
    }


def test_model_without_chat_template_is_422(local_engine: ServerThread) -> None:
    tokenizer = local_engine.extractor.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        url = local_engine.serve()
        body = {"prompts": [{"messages": [{"role": "user", "content": "hi"}]}]}
        response = httpx.post(f"{url}/extract", json=body, headers=AUTH_A, timeout=60)
    finally:
        tokenizer.chat_template = template
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "prompts[0].messages"
    assert "chat template" in response.json()["error"]["message"]
