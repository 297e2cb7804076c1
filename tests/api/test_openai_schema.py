"""The OpenAI routes in the OpenAPI document: vLLM's models, OpenAI's error shape.

``tests/api/test_openapi.py`` runs Schemathesis over every operation of the document;
this checks the OpenAI routes are among the operations it fuzzes, and what they say.
The document needs no engine: the app runs around the fake extractor.
"""

from __future__ import annotations

from typing import Any

import httpx
import schemathesis

from tests.api.conftest import AUTH_A, Served

ROUTES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/chat/completions/render": "ChatCompletionRequest",
    "/v1/completions/render": "CompletionRequest",
    "/detokenize": "DetokenizeRequest",
}


def test_openai_routes_are_documented_and_fuzzed(fake_served: Served) -> None:
    local_url = fake_served.url
    document: dict[str, Any] = httpx.get(
        f"{local_url}/openapi.json", headers=AUTH_A, timeout=30
    ).json()
    for path, request in ROUTES.items():
        post = document["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(f"/{request}")
        assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse"
        )
        assert "422" not in post["responses"]  # validation errors are 400 here
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "502", "503", "504"} <= set(responses)
    assert "/tokenize" in document["paths"]
    assert "HTTPValidationError" not in document["components"]["schemas"]
    schema = schemathesis.openapi.from_url(f"{local_url}/openapi.json", headers=AUTH_A)
    fuzzed = {op.ok().path for op in schema.get_all_operations()}
    assert {*ROUTES, "/tokenize", "/v1/models"} <= fuzzed
