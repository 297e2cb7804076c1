"""The official ``openai`` client against hsx: models, completions, chat, render, tokenize.

On the real engine: stored states are checked against transformers', and the render
routes against a direct call of vLLM's renderer on the engine (render fidelity). The
routes' refusals run without an engine (``test_openai_validation.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.api.conftest import AUTH_A, KEY_A, ServerThread
from tests.api.openai_helpers import assert_durable, vllm_render
from tests.api.openai_helpers import served_name as model_name
from tests.engine.conftest import random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The quick brown fox?"},
    {"role": "assistant", "content": "Jumps over the lazy dog."},
    {"role": "user", "content": [{"type": "text", "text": "Hidden states?"}]},
]


def test_models_in_openai_shape(sync_client: Any, local_engine: ServerThread) -> None:
    models = sync_client.models.list()
    assert [m.id for m in models.data] == [model_name(local_engine)]
    card = models.data[0]
    assert card.object == "model"
    assert card.owned_by == "hsx"
    assert card.created > 0
    extra = card.model_extra
    assert extra["max_model_len"] == 512
    assert extra["layer_ids"] == local_engine.extractor.layer_ids
    assert extra["hidden_size"] == 128


def test_completions_token_ids_and_text(
    sync_client: Any, client: httpx.Client, local_engine: ServerThread
) -> None:
    ids = random_prompts([40, 130], seed=31)
    result = sync_client.completions.create(
        model=model_name(local_engine),
        prompt=ids,
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    assert [c.prompt_token_ids for c in result.choices] == ids
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in result.choices)
    assert result.usage.prompt_tokens == 170
    assert result.usage.completion_tokens == 2
    params = [c.model_extra["kv_transfer_params"] for c in result.choices]
    assert result.model_extra["kv_transfer_params"] == params[0]
    assert params[0]["handle"] != params[1]["handle"]
    for p, token_ids in zip(params, ids, strict=True):
        assert p["handle"].startswith("hsx/team-a/")
        assert_durable(local_engine, client, p, token_ids, AUTH_A)

    text = "The quick brown fox jumps over the lazy dog."
    result = sync_client.completions.create(
        model=model_name(local_engine), prompt=text, max_tokens=3
    )
    (choice,) = result.choices
    assert choice.prompt_token_ids is None  # only when asked, as in vLLM
    expected = client.post("/tokenize", json={"prompt": text}, headers=AUTH_A).json()["tokens"]
    assert expected == local_engine.extractor.tokenizer.encode(text)
    assert result.usage.prompt_tokens == len(expected)
    assert result.usage.completion_tokens == 3
    assert_durable(local_engine, client, choice.model_extra["kv_transfer_params"], expected, AUTH_A)


def test_chat_completions_match_vllm_render(
    sync_client: Any, client: httpx.Client, local_engine: ServerThread
) -> None:
    result = sync_client.chat.completions.create(
        model=model_name(local_engine),
        messages=CONVERSATION,
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    rendered = client.post(
        "/v1/chat/completions/render", json={"messages": CONVERSATION}, headers=AUTH_A
    )
    assert rendered.status_code == 200, rendered.text
    token_ids = rendered.json()["token_ids"]
    assert result.model_extra["prompt_token_ids"] == token_ids
    tokenizer = local_engine.extractor.tokenizer
    assert token_ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")  # turn opened
    (choice,) = result.choices
    assert choice.message.role == "assistant"
    assert len(choice.model_extra["token_ids"]) == 2
    params = result.model_extra["kv_transfer_params"]
    assert choice.model_extra["kv_transfer_params"] == params
    assert_durable(local_engine, client, params, token_ids, AUTH_A)


def test_async_client_completions_and_chat(
    local_url: str, client: httpx.Client, local_engine: ServerThread
) -> None:
    ids = random_prompts([3, 17, 64], seed=32)

    async def run() -> tuple[list[Any], Any, Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{local_url}/v1", api_key=KEY_A, max_retries=0
        ) as aclient:
            models = await aclient.models.list()
            model = models.data[0].id
            completions = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=model, prompt=p, max_tokens=1, extra_body={"return_token_ids": True}
                    )
                    for p in ids
                )
            )
            chat = await aclient.chat.completions.create(
                model=model,
                messages=CONVERSATION[:3],
                max_tokens=1,
                extra_body={"add_generation_prompt": False, "return_token_ids": True},
            )
            return completions, chat, model

    completions, chat, model = asyncio.run(run())
    assert model == model_name(local_engine)
    for result, token_ids in zip(completions, ids, strict=True):
        (choice,) = result.choices
        assert choice.prompt_token_ids == token_ids
        assert_durable(
            local_engine, client, result.model_extra["kv_transfer_params"], token_ids, AUTH_A
        )
    rendered = client.post(
        "/v1/chat/completions/render",
        json={"messages": CONVERSATION[:3], "add_generation_prompt": False},
        headers=AUTH_A,
    ).json()["token_ids"]
    assert chat.model_extra["prompt_token_ids"] == rendered
    assert_durable(local_engine, client, chat.model_extra["kv_transfer_params"], rendered, AUTH_A)


def test_render_and_tokenize_equal_vllms_renderer(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    """hsx answers with vLLM's own renderer; compare with a direct call of it."""
    body = {"messages": CONVERSATION, "add_generation_prompt": True}
    direct = vllm_render(local_engine, **body)
    response = client.post("/v1/chat/completions/render", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    assert response.json()["token_ids"] == direct
    tokenized = client.post("/tokenize", json=body, headers=AUTH_A).json()
    assert tokenized["tokens"] == direct
    assert tokenized["max_model_len"] == 512

    ids = random_prompts([12], seed=33)[0]
    tokenizer = local_engine.extractor.tokenizer
    for prompt, expected in [([ids, ids[:3]], [ids, ids[:3]]), (["fox", "dog"], ["fox", "dog"])]:
        rendered = client.post("/v1/completions/render", json={"prompt": prompt}, headers=AUTH_A)
        assert rendered.status_code == 200, rendered.text
        want = [e if isinstance(e, list) else tokenizer.encode(e) for e in expected]
        assert [r["token_ids"] for r in rendered.json()] == want
    text = client.post("/detokenize", json={"tokens": ids}, headers=AUTH_A).json()["prompt"]
    assert text == tokenizer.decode(ids)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants the weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False},
        {"truncate_prompt_tokens": 8, "truncation_side": "right"},
    ],
    ids=["tools", "continue_final_message", "chat_template_kwargs", "truncation"],
)
def test_chat_fields_render_as_vllm_renders_them(
    client: httpx.Client, local_engine: ServerThread, extra: dict[str, Any]
) -> None:
    body = {"messages": TOOL_CONVERSATION, **extra}
    direct = vllm_render(local_engine, **body)
    response = client.post("/v1/chat/completions/render", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    assert response.json()["token_ids"] == direct
    if "truncate_prompt_tokens" in extra:
        assert len(direct) == 8
