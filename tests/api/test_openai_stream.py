"""``stream: true`` on the OpenAI routes, through the official ``openai`` client.

A stream says what the answer without streaming says (the text, the finish reason, the
usage, each object's ``kv_transfer_params``) in vLLM's chunks, the params on a choice's
final chunk only, and its objects hold the same states. A client that goes mid-stream
leaves no object and an engine that serves on; a failure once the stream has begun is
vLLM's error event, then ``[DONE]``.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service import codecs
from tests.api.conftest import (
    AUTH_A,
    AUTH_FLAKY,
    KEY_A,
    KEY_FLAKY,
    KEYS,
    ServerThread,
    fast_settings,
    objects_under,
)
from tests.api.fake import fake_extractor, fake_server
from tests.api.openai_helpers import served_name, wait_until_idle
from tests.api.test_batch_api_engine import fetch, forget_cached_states, tensor_bytes
from tests.engine.conftest import random_prompts

engine_test = [pytest.mark.engine, pytest.mark.slow]

CONVERSATION: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The quick brown fox?"},
]
#: What names an object, not its states: differs between two objects of one prompt.
NAMING = {"hidden_states_path", "handle", "key", "uri", "sha256", "bytes", "data"}


def params_of(chunk: Any) -> dict[str, Any] | None:
    """A chunk's top-level ``kv_transfer_params`` (vLLM 0.33's field), None if absent."""
    return (chunk.model_extra or {}).get("kv_transfer_params")


def assert_same_object(
    client: httpx.Client, streamed: dict[str, Any] | None, plain: dict[str, Any]
) -> None:
    """Two objects of one prompt: the same params but their names, the same tensors'
    bytes after the safetensors header (which names each object)."""
    assert streamed is not None
    assert streamed.keys() == plain.keys()
    assert {k: v for k, v in streamed.items() if k not in NAMING} == {
        k: v for k, v in plain.items() if k not in NAMING
    }
    assert streamed["key"] != plain["key"]
    if "data" in plain:  # return: inline
        data = [base64.b64decode(p["data"]) for p in (streamed, plain)]
    else:
        data = [fetch(client, p["key"], AUTH_A) for p in (streamed, plain)]
    assert tensor_bytes(data[0]) == tensor_bytes(data[1])


@pytest.mark.engine
@pytest.mark.slow
def test_chat_stream_says_what_the_answer_says(
    sync_client: Any, client: httpx.Client, local_engine: ServerThread
) -> None:
    request = {
        "model": served_name(local_engine),
        "messages": CONVERSATION,
        "max_completion_tokens": 12,
    }
    forget_cached_states(local_engine)
    plain = sync_client.chat.completions.create(**request)
    forget_cached_states(local_engine)
    stream = sync_client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    first, *chunks, usage = list(stream)

    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"
    assert {c.id for c in (first, *chunks, usage)} == {first.id}
    answer = plain.choices[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == answer.finish_reason
    assert usage.choices == []
    assert usage.usage == plain.usage
    # kv_transfer_params come with the final chunk only, and are the answer's choice's.
    assert [params_of(c) is not None for c in (first, *chunks, usage)] == [
        *[False] * len(chunks),
        True,
        False,
    ]
    assert_same_object(client, params_of(chunks[-1]), answer.model_extra["kv_transfer_params"])


@pytest.mark.engine
@pytest.mark.slow
def test_completion_stream_has_a_final_chunk_per_prompt(
    sync_client: Any, client: httpx.Client, local_engine: ServerThread
) -> None:
    prompts = random_prompts([30, 70], seed=61)
    request = {
        "model": served_name(local_engine),
        "prompt": prompts,
        "max_tokens": 6,
        "extra_body": {"return_token_ids": True},
    }
    forget_cached_states(local_engine)
    plain = sync_client.completions.create(**request)
    forget_cached_states(local_engine)
    chunks = list(sync_client.completions.create(**request, stream=True))

    assert {c.object for c in chunks} == {"text_completion"}
    assert len({c.id for c in chunks}) == 1
    for answer in plain.choices:
        mine = [c for c in chunks if c.choices[0].index == answer.index]
        assert "".join(c.choices[0].text for c in mine) == answer.text
        ids = [i for c in mine for i in c.choices[0].model_extra["token_ids"]]
        assert ids == answer.token_ids
        assert mine[0].choices[0].model_extra["prompt_token_ids"] == prompts[answer.index]
        # The final chunk of each choice (its finish reason) names its object, only it.
        assert [c.choices[0].finish_reason for c in mine][-1] == answer.finish_reason
        assert [params_of(c) is not None for c in mine] == [False] * (len(mine) - 1) + [True]
        params = answer.model_extra["kv_transfer_params"]
        assert_same_object(client, params_of(mine[-1]), params)


@pytest.mark.engine
@pytest.mark.slow
def test_inline_answers_and_selections_stream_as_without_streaming(
    sync_client: Any, client: httpx.Client, local_engine: ServerThread
) -> None:
    root: Path = local_engine.root  # type: ignore[attr-defined]
    before = objects_under(root, "team-a")
    hsx = {"return": "inline", "include_output_tokens": True, "tokens": "last"}
    prompt = random_prompts([20], seed=62)[0]
    request = {
        "model": served_name(local_engine),
        "prompt": prompt,
        "max_tokens": 3,
        "extra_body": {**hsx, "return_token_ids": True},
    }
    forget_cached_states(local_engine)
    plain = sync_client.completions.create(**request)
    forget_cached_states(local_engine)
    (chunk,) = list(sync_client.completions.create(**request, stream=True))

    streamed = params_of(chunk)
    assert streamed is not None
    assert_same_object(client, streamed, plain.choices[0].model_extra["kv_transfer_params"])
    tensors, meta = codecs.decode(base64.b64decode(streamed["data"]))
    assert streamed["shape"][0] == 1  # the last token's states
    assert meta[codecs.TOKENS_KEY] == '"last"'
    generated = chunk.choices[0].model_extra["token_ids"]
    assert generated == plain.choices[0].model_extra["token_ids"]
    # The prompt and the output tokens (the last generated one has no states).
    assert tensors["token_ids"].tolist() == prompt + generated[:-1]
    assert objects_under(root, "team-a") == before  # inline: stored nowhere


def aborts(url: str, reason: str) -> float:
    """``hsx_extract_aborts_total{reason=...}`` on ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "hsx_extract_aborts_total" and sample.labels["reason"] == reason:
                return sample.value
    return 0.0


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit_s:g} s: {what}"
        time.sleep(0.02)


def chat_then_close(client: Any, model: str) -> None:
    """Read the role chunk, then go."""
    stream = client.chat.completions.create(
        model=model, messages=CONVERSATION, max_completion_tokens=400, stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()


def completion_then_close(client: Any, model: str) -> None:
    """Go once the answer has started (its 200 and headers): its first chunk would be
    its last, once the object is durable."""
    prompt = random_prompts([40], seed=63)[0]
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=400, stream=True)
    assert stream.response.headers["content-type"].startswith("text/event-stream")
    stream.close()


@pytest.mark.parametrize(
    "go",
    [
        pytest.param(chat_then_close, marks=engine_test, id="chat"),
        pytest.param(completion_then_close, marks=engine_test, id="completion"),
    ],
)
def test_a_client_gone_mid_stream_leaves_no_object(
    go: Callable[[Any, str], None], local_engine: ServerThread
) -> None:
    # 400 tokens to generate: seconds of decoding on any machine, so the client is gone
    # long before an object could be written.
    url = local_engine.serve(max_tokens=400)
    root: Path = local_engine.root  # type: ignore[attr-defined]
    model, before = served_name(local_engine), objects_under(root, "team-a")
    aborted = aborts(url, "disconnect")
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0) as client:
        go(client, model)
        wait_for(lambda: aborts(url, "disconnect") == aborted + 1, "the disconnect is counted")
        wait_until_idle(local_engine)  # the engine request was aborted
        wait_for(lambda: gauge(url, "hsx_writer_bytes_in_flight_bytes") == 0, "nothing held")
        assert objects_under(root, "team-a") == before

        # The engine serves on, streams included.
        chunks = list(
            client.chat.completions.create(
                model=model, messages=CONVERSATION, max_completion_tokens=2, stream=True
            )
        )
        params = params_of(chunks[-1])
        assert params is not None
        assert objects_under(root, "team-a") == before | {params["key"]}


def events(response: httpx.Response) -> list[str]:
    """The ``data`` of each server-sent event, as sent."""
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-1] == ""  # every event ends with a blank line
    assert all(f.startswith("data: ") for f in frames[:-1]), frames
    return [f.removeprefix("data: ") for f in frames[:-1]]


@pytest.mark.engine
@pytest.mark.slow
def test_a_storage_failure_mid_stream_is_an_error_event(
    client: httpx.Client, local_url: str, local_engine: ServerThread
) -> None:
    lengths = [4, 5, 6, 7]  # odd token counts fail in the "flaky" namespace
    body = {
        "model": served_name(local_engine),
        "prompt": random_prompts(lengths, seed=52),
        "max_tokens": 1,
        "stream": True,
    }
    response = client.post("/v1/completions", json=body, headers=AUTH_FLAKY)
    assert response.status_code == 200  # the stream had begun
    error, done = events(response)
    assert done == "[DONE]"
    # The body the answer without streaming carries (its 502), vLLM's error shape.
    answer = json.loads(error)
    assert answer["error"]["type"] == "storage_error"
    assert answer["error"]["code"] == 502
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert [("key" in o) for o in answer["objects"]] == [n % 2 == 0 for n in lengths]

    # The official client raises it as an API error.
    with openai.OpenAI(base_url=f"{local_url}/v1", api_key=KEY_FLAKY, max_retries=0) as sdk:
        model, prompt = served_name(local_engine), random_prompts(lengths, seed=52)
        stream = sdk.completions.create(model=model, prompt=prompt, max_tokens=1, stream=True)
        with pytest.raises(openai.APIError, match="2 of 4 prompts failed"):
            list(stream)


def test_a_refusal_before_the_stream_is_json(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Admission comes before the stream's first byte: an overload is still a 429."""
    fake = fake_extractor(tmp_path / "objects", tokenizer_dir)
    with fake_server(fast_settings(tmp_path, max_queued_prompts=1), fake, KEYS) as server:
        body = {"prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 1, "stream": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH_A)
        assert response.status_code == 429
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["type"] == "overloaded"
        assert fake.submitted == 0
        body["prompt"] = [1, 2, 3]
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH_A)
        assert response.status_code == 200
        assert events(response)[-1] == "[DONE]"
