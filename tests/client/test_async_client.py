"""``AsyncHsxClient`` and ``HsxClient`` against ``httpx.MockTransport``: the requests
they build (auth header, bodies), the typed answers, and the one error they raise."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from service.client import (
    AsyncHsxClient,
    BadResponseError,
    ExtractOptions,
    HsxClient,
    HsxError,
)
from service.client.models import ExtractResponse, ModelList

ANSWER = ExtractResponse.model_json_schema()["examples"][0]
CARD = {
    "id": "tiny", "object": "model", "created": 1, "owned_by": "hsx", "layer_ids": [1, 2],
    "hidden_size": 4, "dtype": "float32", "max_model_len": 64, "storage_backend": "file",
    "codecs": ["raw", "fp8"], "default_codec": "raw",
}  # fmt: skip

Handler = Callable[[httpx.Request], httpx.Response]


class Recorded:
    """A MockTransport handler that answers from ``routes`` and keeps every request."""

    def __init__(self, routes: dict[tuple[str, str], Handler]) -> None:
        self.routes, self.requests = routes, []  # type: ignore[var-annotated]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.routes[(request.method, request.url.path)](request)


def answer(status: int, body: Any, **headers: str) -> Handler:
    return lambda request: httpx.Response(status, json=body, headers=headers)


def run_async(handler: Recorded, work: Callable[[AsyncHsxClient], Any], **kw: Any) -> Any:
    async def main() -> Any:
        transport = httpx.MockTransport(handler)
        async with AsyncHsxClient("http://hsx:8000/", "k-123", transport=transport, **kw) as c:
            return await work(c)

    return asyncio.run(main())


def test_extract_sends_the_key_and_the_options_and_answers_typed() -> None:
    handler = Recorded({("POST", "/extract"): answer(200, ANSWER)})
    options = ExtractOptions(max_tokens=2, loss="assistant", codec="fp8", layers=(2, 4))
    got = run_async(handler, lambda c: c.extract(["hi"], options))
    assert isinstance(got, ExtractResponse)
    assert got.objects[0].key == ANSWER["objects"][0]["key"]
    assert got["objects"][0]["key"] == got.objects[0].key  # the dict-era reading still works
    (request,) = handler.requests
    assert request.headers["Authorization"] == "Bearer k-123"
    assert request.url == "http://hsx:8000/extract"
    assert json.loads(request.content) == {
        "prompts": ["hi"], "max_tokens": 2, "include_output_tokens": False,
        "loss": "assistant", "codec": "fp8", "layers": [2, 4],
    }  # fmt: skip


def test_no_key_no_header_and_token_ids_become_prompt_objects() -> None:
    handler = Recorded({("POST", "/extract"): answer(200, ANSWER)})
    with HsxClient("http://hsx", transport=httpx.MockTransport(handler)) as client:
        client.extract([[1, 2, 3]], metadata={"split": "train"})
    (request,) = handler.requests
    assert "Authorization" not in request.headers
    body = json.loads(request.content)
    assert body["prompts"] == [{"token_ids": [1, 2, 3]}]
    assert body["metadata"] == {"split": "train"}
    assert "loss" not in body  # the server's defaults
    assert "codec" not in body


def test_an_error_answer_is_one_hsx_error_with_its_fields() -> None:
    error = {"error": {"type": "invalid_request", "message": "prompts[1]: no", "index": 1}}
    handler = Recorded({("POST", "/extract"): answer(422, error)})
    with pytest.raises(HsxError) as caught:
        run_async(handler, lambda c: c.extract(["a", "b"]))
    exc = caught.value
    assert (exc.status, exc.type, exc.message, exc.index) == (
        422,
        "invalid_request",
        "prompts[1]: no",
        1,
    )
    assert str(exc) == "422 invalid_request: prompts[1]: no"
    assert not isinstance(exc, BadResponseError)


def test_retry_after_and_a_body_that_is_not_hsx() -> None:
    busy = {"error": {"type": "overloaded", "message": "later"}}
    proxy = lambda request: httpx.Response(502, text="<html>bad gateway</html>")  # noqa: E731
    handler = Recorded(
        {
            ("POST", "/extract"): answer(429, busy, **{"Retry-After": "7"}),
            ("GET", "/version"): proxy,
        }
    )
    with pytest.raises(HsxError) as caught:
        run_async(handler, lambda c: c.extract(["a"]))
    assert (caught.value.status, caught.value.retry_after) == (429, 7.0)
    with pytest.raises(HsxError) as caught:
        run_async(handler, lambda c: c.version())
    assert (caught.value.type, caught.value.message) == ("error", "<html>bad gateway</html>")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html>", "200 with a body that is not JSON (text/html): '<html>'"),
        (b"[]", "200 without an objects list (text/html): []"),
        (b'{"objects": [{"index": 0}]}', "objects[0].key is missing or not str"),
        (b'{"objects": []}', "200 without any of the 2 prompts' objects"),
        (b'{"objects": [{"index": 5, "key": "k", "num_tokens": 1, "bytes": 1, "sha256": "s"}]}',
         "objects[0].index 5 is not a prompt's"),
    ],
)  # fmt: skip
def test_a_200_that_is_not_an_extract_answer_is_a_bad_response(body: bytes, message: str) -> None:
    page = lambda request: httpx.Response(200, content=body, headers={"content-type": "text/html"})  # noqa: E731
    handler = Recorded({("POST", "/extract"): page})
    with pytest.raises(BadResponseError) as caught:
        run_async(handler, lambda c: c.extract(["a", "b"]))
    assert (caught.value.status, caught.value.type) == (200, "bad_response")
    assert caught.value.message == message


def test_models_version_tokenize_and_objects() -> None:
    handler = Recorded({
        ("GET", "/v1/models"): answer(200, {"object": "list", "data": [CARD]}),
        ("GET", "/version"): answer(200, {"version": "0.1.0", "vllm": "0.32.0"}),
        ("POST", "/tokenize"): answer(200, {"count": 3, "max_model_len": 64, "tokens": [1, 2, 3]}),
        ("GET", "/objects/hsx/a/x.safetensors"): lambda r: httpx.Response(200, content=b"bytes"),
        ("DELETE", "/objects/hsx/a/x.safetensors"): lambda r: httpx.Response(204),
    })  # fmt: skip

    async def work(client: AsyncHsxClient) -> tuple[Any, ...]:
        return (
            await client.models(),
            await client.version(),
            await client.tokenize("tiny", {"messages": [{"role": "user", "content": "hi"}]}),
            await client.get_object("hsx/a/x.safetensors"),
            await client.delete("hsx/a/x.safetensors"),
        )

    models, version, tokens, data, deleted = run_async(handler, work)
    assert isinstance(models, ModelList)
    assert (models.data[0].id, models.data[0].codecs) == ("tiny", ["raw", "fp8"])
    assert version.version == "0.1.0"
    assert tokens.count == 3
    assert (data, deleted) == (b"bytes", None)
    sent = json.loads(handler.requests[2].content)
    assert sent == {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "add_generation_prompt": True}  # fmt: skip


def test_a_model_list_without_hsx_fields_is_a_bad_response() -> None:
    openai = {"object": "list", "data": [{"id": "gpt", "object": "model"}]}
    handler = Recorded({("GET", "/v1/models"): answer(200, openai)})
    with pytest.raises(BadResponseError, match=r"200 that is not hsx's answer \(data\.0\."):
        run_async(handler, lambda c: c.models())


def test_an_unencodable_prompt_fails_before_anything_is_sent() -> None:
    handler = Recorded({})
    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
        run_async(handler, lambda c: c.extract(["lone \ud800"]))
    assert handler.requests == []
