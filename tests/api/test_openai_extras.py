"""hsx's own fields in the OpenAI routes' extra body (issue 58, L4), through the official
``openai`` client: ``ttl_s`` is honoured as on ``/extract``, a near miss of an hsx
field's name is a 400 naming it, and any other unknown field is ignored, as vLLM
ignores it. Fast: the fake extractor over real local storage behind a real uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.conftest import AUTH_A, KEY_A, Served
from tests.support.processes import wait_until

IDS = [5, 6, 7]


@pytest.fixture
def oai(fake_served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{fake_served.url}/v1", api_key=KEY_A, max_retries=0) as c:
        yield c


def _complete(oai: openai.OpenAI, served: Served, **extra_body: Any) -> dict[str, Any]:
    done = oai.completions.create(
        model=served.name, prompt=IDS, max_tokens=1, extra_body=extra_body
    )
    assert done.model_extra is not None
    params: dict[str, Any] = done.model_extra["kv_transfer_params"]
    return params


def _status(client: httpx.Client, key: str) -> int:
    return client.get(f"/objects/{key}", headers=AUTH_A).status_code


def test_ttl_s_expires_the_object_as_on_extract(
    oai: openai.OpenAI, fake_served: Served, fake_client: httpx.Client
) -> None:
    expiring = _complete(oai, fake_served, ttl_s=1)
    kept = _complete(oai, fake_served)
    assert Path(expiring["hidden_states_path"]).exists()
    wait_until(lambda: _status(fake_client, expiring["key"]) == 404, 10, "object never expired")
    assert _status(fake_client, kept["key"]) == 200  # no ttl_s: the server's default, none


@pytest.mark.parametrize(
    ("extra", "param", "meant"),
    [({"tokns": "last"}, "tokns", "tokens"), ({"retrun": "inline"}, "retrun", "return")],
)
def test_a_misspelled_hsx_field_is_400_naming_it(
    oai: openai.OpenAI, fake_served: Served, extra: dict[str, Any], param: str, meant: str
) -> None:
    submitted = fake_served.engine_requests()
    with pytest.raises(openai.BadRequestError) as refused:
        _complete(oai, fake_served, **extra)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["message"] == f"{param}: unknown field; did you mean {meant!r}?"
    assert fake_served.engine_requests() == submitted


def test_other_unknown_fields_are_ignored_as_vllm_ignores_them(
    oai: openai.OpenAI, fake_served: Served, fake_client: httpx.Client
) -> None:
    params = _complete(oai, fake_served, trace_id="abc-123", vendor={"x": 1})
    assert _status(fake_client, params["key"]) == 200
