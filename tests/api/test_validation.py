"""Every class of bad input gets its 4xx in the one error shape, names the field, and
never reaches the engine. Fast: the app around the fake extractor (real tokenizer)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from service.api.prompts import max_token_bytes
from tests.api.conftest import AUTH_A, KEYS, fast_settings
from tests.api.fake import serving_in_process

JSON = {**AUTH_A, "Content-Type": "application/json"}

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
    # A window's error names the window's field, not the named choices (issue 58, L7).
    (
        "window index a float",
        {"prompts": ["a"], "tokens": {"start": 0.0, "end": 2}},
        422,
        "tokens.start",
        None,
    ),
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
async def test_bad_input_is_refused_before_the_engine(
    app_client: httpx.AsyncClient,
    fake: Any,
    name: str,
    body: Any,
    status: int,
    field: str,
    index: int | None,
) -> None:
    response = await app_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) <= {"type", "message", "field", "index"}
    assert error["message"]
    if field:
        assert error["field"] == field
        assert error["message"].startswith(field)
    assert error.get("index") == index
    assert fake.submitted == 0


# Bodies that are not JSON at all: the same 422 shape, field "body", saying why.
MALFORMED: list[tuple[str, bytes, str]] = [
    ("truncated JSON", b'{"prompts": [', "not valid JSON"),
    ("not UTF-8", b'{"prompts": ["\xff\xfe"]}', "UTF-8"),
    ("integer over 4300 digits", b'{"prompts": [{"token_ids": [' + b"9" * 5000 + b"]}]}", "digits"),
    ("nested 1000 deep", b'{"prompts": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"),
    ("empty object", b"{", "not valid JSON"),
]


@pytest.mark.parametrize(("name", "content", "says"), MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_body_is_422_invalid_request(
    app_client: httpx.AsyncClient, fake: Any, name: str, content: bytes, says: str
) -> None:
    response = await app_client.post("/extract", content=content, headers=JSON)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["field"] == "body"
    assert error["message"].startswith("body: ")
    assert says in error["message"]
    assert fake.submitted == 0


async def test_declared_body_over_the_limit_is_413(app_client: httpx.AsyncClient) -> None:
    response = await app_client.post("/extract", content=b"x" * 70000, headers=JSON)
    assert response.status_code == 413
    assert response.json()["error"] == {
        "type": "payload_too_large",
        "message": "body: request body is larger than 65536 bytes",
        "field": "body",
    }


async def test_chunked_body_over_the_limit_is_413_without_reading_it_all(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    sent = 0

    async def chunks() -> Any:
        nonlocal sent
        for _ in range(100):  # 1.6 MB offered, 64 KiB allowed
            sent += 16384
            yield b"x" * 16384

    response = await app_client.post("/extract", content=chunks(), headers=JSON)
    assert response.status_code == 413
    assert response.json()["error"]["field"] == "body"
    assert sent < 200_000  # stopped reading at the limit
    assert fake.submitted == 0


async def test_model_without_chat_template_is_422(app_client: httpx.AsyncClient, fake: Any) -> None:
    fake.tokenizer.chat_template = None
    body = {"prompts": [{"messages": [{"role": "user", "content": "hi"}]}]}
    response = await app_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "prompts[0].messages"
    assert "chat template" in response.json()["error"]["message"]
    assert fake.submitted == 0


async def test_text_that_cannot_fit_is_refused_before_tokenising(fake: Any, tmp_path: Any) -> None:
    calls: list[int] = []
    encode = fake.tokenizer.encode

    def spy(text: str, **kwargs: Any) -> Any:
        calls.append(len(text))
        return encode(text, **kwargs)

    fake.tokenizer.encode = spy
    settings = fast_settings(tmp_path, max_body_bytes=16 * 1024 * 1024)
    bound = 511 * max_token_bytes(fake.tokenizer)  # max_model_len 512 - max_tokens 1
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        huge = await client.post(
            "/extract", json={"prompts": ["ok", {"text": "hello world " * 691000}]}, headers=AUTH_A
        )
        chat = await client.post(
            "/extract",
            json={"prompts": [{"messages": [{"role": "user", "content": "x" * (bound + 1)}]}]},
            headers=AUTH_A,
        )
        assert calls == []  # neither reached the tokenizer
        fits = await client.post("/extract", json={"prompts": ["a" * bound]}, headers=AUTH_A)
    assert huge.status_code == 422
    error = huge.json()["error"]
    assert error["type"] == "limit_exceeded"
    assert error["field"] == "prompts[1].text"
    assert error["index"] == 1
    assert "8292000 bytes of text cannot fit in 511 tokens" in error["message"]
    assert chat.status_code == 422
    assert chat.json()["error"]["field"] == "prompts[0].messages"
    # Within the byte bound: tokenised, then refused on its token count.
    assert calls == [bound]
    assert fits.status_code == 422
    assert "tokens; at most 511" in fits.json()["error"]["message"]
    assert fake.submitted == 0


async def test_many_empty_messages_are_refused_before_validation(fake: Any, tmp_path: Any) -> None:
    """Issue 26, finding 2: 250,000 empty messages weighed 0 bytes and were rendered to
    1.25 M tokens before the 422. They are counted before the body is validated."""
    renders: list[int] = []
    template = fake.tokenizer.apply_chat_template
    fake.tokenizer.apply_chat_template = lambda m, **kw: renders.append(len(m)) or template(m, **kw)
    settings = fast_settings(tmp_path, max_body_bytes=16 * 1024 * 1024)
    empty = {"role": "user", "content": ""}
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        many = await client.post(
            "/extract", json={"prompts": [{"messages": [empty] * 250_000}]}, headers=AUTH_A
        )
        # Under the message limit, but 600 messages take 600 tokens: more than 511.
        long = await client.post(
            "/extract", json={"prompts": ["ok", {"messages": [empty] * 600}]}, headers=AUTH_A
        )
    assert many.status_code == 422
    assert many.json()["error"] == {
        "type": "limit_exceeded",
        "message": "prompts: 250000 chat messages; at most 1024",
        "field": "prompts",
    }
    assert long.status_code == 422
    error = long.json()["error"]
    assert error["type"] == "limit_exceeded"
    assert error["field"] == "prompts[1].messages"
    assert error["index"] == 1
    assert "9000 bytes of text in 600 messages cannot fit in 511 tokens" in error["message"]
    assert renders == []
    assert fake.submitted == 0


async def test_assistant_mask_over_1000_messages_is_linear(fake: Any, tmp_path: Any) -> None:
    """Issue 26, finding 9: ``loss=assistant`` tokenised every turn's render whole, a
    cost quadratic in the turns (3.5 s of CPU for these 1,000 messages). The mask is the
    per-turn renders' boundaries still, from one tokenisation of the conversation."""
    import time

    from service import masks

    fake.max_model_len = 32768
    spans: list[Any] = []
    extract = fake.extract

    async def spy(ids: Any, params: Any, **options: Any) -> Any:
        spans.append(params.loss_spans)
        return await extract(ids, params, **options)

    fake.extract = spy
    text = "The quick brown fox"
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": f"{text} {i}"} for i in range(1000)
    ]
    settings = fast_settings(tmp_path, max_total_tokens=32768)
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        started = time.process_time()  # every thread of this process: the app's pool too
        response = await client.post(
            "/extract",
            json={"prompts": [{"messages": messages}], "loss": "assistant"},
            headers=AUTH_A,
        )
        spent = time.process_time() - started
    print(f"loss=assistant over 1000 messages: {spent:.2f} s of CPU")
    assert response.status_code == 200, response.text
    (found,) = spans
    assert len(found) == 500  # every assistant turn
    for j in (1, 499, 999):  # speculators' boundary, by whole renders, on three turns
        start = masks.render_ids(fake.tokenizer, messages[:j], add_generation_prompt=True)
        end = masks.render_ids(fake.tokenizer, messages[: j + 1], add_generation_prompt=False)
        assert (len(start), len(end)) in found
    assert spent < 1.5
