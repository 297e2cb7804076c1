"""The OpenAPI document: examples present (no engine needed: the fake's app serves the
same document), and Schemathesis finds no 5xx or off-schema reply from the real engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from tests.api.conftest import AUTH_A, Served


@pytest.fixture(scope="module")
def openapi_document(fake_served: Served) -> dict[str, Any]:
    response = httpx.get(f"{fake_served.url}/openapi.json", headers=AUTH_A, timeout=30)
    assert response.status_code == 200
    return dict(response.json())


def test_document_has_examples_and_error_shapes(openapi_document: dict[str, Any]) -> None:
    schemas = openapi_document["components"]["schemas"]
    assert schemas["ExtractRequest"]["examples"]
    assert schemas["ExtractResponse"]["examples"]
    extract = openapi_document["paths"]["/extract"]["post"]
    for status in ("401", "413", "422", "429", "502", "503", "504"):
        assert status in extract["responses"], status
    assert "HTTPValidationError" not in schemas  # every 422 uses the shared error shape
    assert openapi_document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


@pytest.fixture(scope="module")
def api_schema(local_url: str) -> Any:
    return schemathesis.openapi.from_url(f"{local_url}/openapi.json", headers=AUTH_A)


# What the contract promises: no 5xx, and every reply (status, body, headers) is one
# the document describes. Not "every schema-valid body is accepted": a valid body can
# still exceed a limit or name a token past the vocabulary, and gets a documented 422.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.response_schema_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
]


@pytest.mark.engine
@pytest.mark.slow
def test_no_server_errors_and_replies_match_the_schema(api_schema: Any) -> None:
    """Every operation, fuzzed from the document; each reply checked against it."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 7
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case: Any) -> None:
            case.call_and_validate(headers=AUTH_A, timeout=60, checks=CHECKS)

        check()
