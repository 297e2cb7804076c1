"""Bad input on the OpenAI routes: its status, OpenAI's error shape, the field named in
``param`` and the message, and no engine request made.

No engine needed: the app runs around the fake extractor, whose front end is vLLM's own
renderer on the tiny model (``tests.api.fake``), so vLLM's refusals are the real ones.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import AUTH_A, Served
from tests.api.openai_helpers import counter

IDS = [5, 6, 7]
CHAT = [{"role": "user", "content": "The quick brown fox?"}]
CMPL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
BIG = "hello world " * 4_000  # 48 kB: under the body limit, over 512 tokens of 34 bytes
EMPTY = [{"role": "user", "content": ""}]

# (name, path, body, status, param): param None where vLLM's own check names no field.
CASES: list[tuple[str, str, dict[str, Any], int, str | None]] = [
    # A stream is refused as an answer is, before its first byte: the same JSON.
    ("stream n > 1", CMPL, {"prompt": IDS, "stream": True, "n": 2}, 400, "n"),
    ("stream max_tokens over limit", CMPL, {"prompt": IDS, "stream": True, "max_tokens": 65},
     400, "max_tokens"),
    ("n > 1", CMPL, {"prompt": IDS, "n": 2}, 400, "n"),
    ("best_of", CMPL, {"prompt": IDS, "best_of": 2}, 400, "best_of"),
    ("beam search", CMPL, {"prompt": IDS, "use_beam_search": True}, 400, "use_beam_search"),
    ("logprobs", CMPL, {"prompt": IDS, "logprobs": 1}, 400, "logprobs"),
    ("prompt logprobs", CMPL, {"prompt": IDS, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("echo", CMPL, {"prompt": IDS, "echo": True}, 400, "echo"),
    (
        "client kv_transfer_params",
        CMPL,
        {"prompt": IDS, "kv_transfer_params": {"hidden_states_path": "/etc/passwd"}},
        400,
        "kv_transfer_params",
    ),
    ("sampling", CMPL, {"prompt": IDS, "temperature": 0.8}, 400, "temperature"),
    ("stop", CMPL, {"prompt": IDS, "stop": ["fox"]}, 400, "stop"),
    ("unknown model", CMPL, {"prompt": IDS, "model": "gpt-4"}, 404, "model"),
    ("prompt type", CMPL, {"prompt": 5}, 400, "prompt"),
    ("empty prompt", CMPL, {"prompt": ""}, 400, "prompt"),
    ("max_tokens 0", CMPL, {"prompt": IDS, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens over limit", CMPL, {"prompt": IDS, "max_tokens": 65}, 400, "max_tokens"),
    ("too many prompts", CMPL, {"prompt": [IDS] * 9}, 400, "prompt"),
    ("id past vocab", CMPL, {"prompt": [[1, 2], [1, 512]]}, 400, "prompt[1]"),
    ("prompt over max_model_len", CMPL, {"prompt": [1] * 600}, 400, "input_tokens"),
    # vLLM's default max_tokens of 16 leaves 496 tokens for the prompt.
    ("prompt + max_tokens too long", CMPL, {"prompt": [1] * 500}, 400, "prompt"),
    ("too many tokens", CMPL, {"prompt": [[1] * 500] * 3, "max_tokens": 1}, 400, "prompt"),
    ("chat stream logprobs", CHAT_URL, {"messages": CHAT, "stream": True, "logprobs": True}, 400,
     "logprobs"),
    ("chat n > 1", CHAT_URL, {"messages": CHAT, "n": 3}, 400, "n"),
    ("chat logprobs", CHAT_URL, {"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    ("chat unknown model", CHAT_URL, {"messages": CHAT, "model": "x"}, 404, "model"),
    ("chat no messages", CHAT_URL, {}, 400, "messages"),
    (
        "chat bad role",
        CHAT_URL,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        "chat kv_transfer_params",
        CHAT_URL,
        {"messages": CHAT, "kv_transfer_params": {"handle": "x"}},
        400,
        "kv_transfer_params",
    ),
    (
        "chat max_tokens over limit",
        CHAT_URL,
        {"messages": CHAT, "max_completion_tokens": 65},
        400,
        "max_tokens",
    ),
    (
        "chat template from the client",
        CHAT_URL,
        {"messages": CHAT, "chat_template": "{{ 'x' }}"},
        400,
        None,
    ),
    ("render unknown model", "/v1/chat/completions/render", {**{"messages": CHAT}, "model": "x"},
     404, "model"),
    ("render no messages", "/v1/chat/completions/render", {}, 400, "messages"),
    ("completion render type", "/v1/completions/render", {"prompt": {"a": 1}}, 400, "prompt"),
    ("tokenize unknown model", "/tokenize", {"prompt": "a", "model": "x"}, 404, "model"),
    ("detokenize negative", "/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    # Text too long to fit is refused from its size, before vLLM's renderer tokenises it.
    ("text cannot fit", CMPL, {"prompt": BIG}, 400, "prompt"),
    ("one text cannot fit", CMPL, {"prompt": ["hi", BIG]}, 400, "prompt[1]"),
    ("chat text cannot fit", CHAT_URL, {"messages": [{"role": "user", "content": BIG}]},
     400, "messages"),
    ("chat parts cannot fit", CHAT_URL,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]}, 400, "messages"),
    ("render text cannot fit", "/v1/chat/completions/render",
     {"messages": [{"role": "user", "content": BIG}]}, 400, "messages"),
    ("completion render text cannot fit", "/v1/completions/render", {"prompt": BIG}, 400, "prompt"),
    ("tokenize text cannot fit", "/tokenize", {"prompt": BIG}, 400, "prompt"),
    # Everything vLLM's chat parser and the template can write counts (issue 26, 1):
    # parts of every type, names, tool schemas, and one token per message.
    ("refusal part cannot fit", "/tokenize",
     {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": BIG}]}]},
     400, "messages"),
    ("thinking part cannot fit", "/v1/chat/completions/render",
     {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": BIG}]}]},
     400, "messages"),
    ("name cannot fit", CHAT_URL, {"messages": [{"role": "user", "content": "hi", "name": BIG}]},
     400, "messages"),
    ("tool schema cannot fit", CHAT_URL,
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f",
                                                                    "description": BIG}}]},
     400, "messages"),
    ("empty messages cannot fit", "/v1/chat/completions/render", {"messages": EMPTY * 600},
     400, "messages"),
    ("too many messages", "/tokenize", {"messages": EMPTY * 1025}, 400, "messages"),
    # What an answer may hold (issue 26, 12): prompts, tokens, token ids to decode.
    ("render too many prompts", "/v1/completions/render", {"prompt": [IDS] * 9}, 400, "prompt"),
    ("render too many tokens", "/v1/completions/render", {"prompt": [[1] * 500] * 3}, 400,
     "prompt"),
    ("tokenize past max_model_len", "/tokenize", {"prompt": "\u00e9" * 600}, 400, "prompt"),
    ("detokenize past max_model_len", "/detokenize", {"tokens": [5] * 513}, 400, "tokens"),
    # hsx's own fields are strict (issue 58, L4): a near miss of their names, a bad
    # ttl_s, one put in vllm_xargs; a mistyped window names its field (L7).
    ("misspelled tokens", CMPL, {"prompt": IDS, "tokns": "last"}, 400, "tokns"),
    ("misspelled return", CHAT_URL, {"messages": CHAT, "retrun": "inline"}, 400, "retrun"),
    ("misspelled ttl_s", CMPL, {"prompt": IDS, "ttl": 60}, 400, "ttl"),
    ("ttl_s zero", CMPL, {"prompt": IDS, "ttl_s": 0}, 400, "ttl_s"),
    ("ttl_s a string", CHAT_URL, {"messages": CHAT, "ttl_s": "60"}, 400, "ttl_s"),
    ("hsx field in vllm_xargs", CMPL, {"prompt": IDS, "vllm_xargs": {"tokens": "last"}}, 400,
     "vllm_xargs.tokens"),
    ("window index a float", CMPL, {"prompt": IDS, "tokens": {"start": 0.0, "end": 2}}, 400,
     "tokens.start"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_refused_before_the_engine(
    fake_client: httpx.Client,
    fake_served: Served,
    name: str,
    path: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    client, local_url, engine_requests = fake_client, fake_served.url, fake_served.engine_requests
    body = {"model": fake_served.name, **body}
    engine, prompts = engine_requests(), counter(local_url, "hsx_extract_prompts_total")
    response = client.post(path, json=body, headers=AUTH_A)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["message"]
    assert error["param"] == param, error
    if param is not None:
        assert param.split("[")[0] in error["message"]
    assert engine_requests() == engine
    assert counter(local_url, "hsx_extract_prompts_total") == prompts


def test_malformed_json_is_400(fake_client: httpx.Client, fake_served: Served) -> None:
    client, engine_requests = fake_client, fake_served.engine_requests
    engine = engine_requests()
    response = client.post(
        CMPL, content=b'{"prompt": [', headers={**AUTH_A, "Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400
    assert engine_requests() == engine
