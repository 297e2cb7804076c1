"""``loss`` on /extract: the stored loss_mask, over real HTTP and a real engine; the
refusals (before the engine) on the fake, whose tokenizer and template are the same.

The tiny model's template writes ``<|role|>content\\n`` per message, so the assistant's
supervised text is its content and the newline that ends its turn.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from safetensors.torch import load

from tests.api.conftest import AUTH_A, Served, ServerThread, objects_under
from tests.api.openai_helpers import served_name

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The quick brown fox?"},
    {"role": "assistant", "content": "jumps over the lazy dog."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Hidden states."},
]


def stored(client: httpx.Client, obj: dict[str, Any]) -> dict[str, Any]:
    return load(client.get(f"/objects/{obj['key']}", headers=AUTH_A).content)


def supervised_text(tokenizer: Any, tensors: dict[str, Any]) -> list[str]:
    from service.masks import mask_to_spans

    ids, mask = tensors["token_ids"].tolist(), tensors["loss_mask"].tolist()
    return [tokenizer.decode(ids[s:e]) for s, e in mask_to_spans(mask)]


@pytest.mark.engine
@pytest.mark.slow
def test_assistant_and_last_turn_masks(client: httpx.Client, local_engine: ServerThread) -> None:
    tokenizer = local_engine.extractor.tokenizer
    for loss, expected in [
        ("assistant", ["jumps over the lazy dog.\n", "Hidden states.\n"]),
        ("last_turn", ["Hidden states.\n"]),
    ]:
        body = {"prompts": [{"messages": CHAT}], "loss": loss}
        response = client.post("/extract", json=body, headers=AUTH_A)
        assert response.status_code == 200, response.text
        obj = response.json()["objects"][0]
        tensors = stored(client, obj)
        mask = tensors["loss_mask"]
        assert str(mask.dtype) == "torch.uint8"
        assert mask.shape == tensors["token_ids"].shape == (obj["num_tokens"],)
        assert supervised_text(tokenizer, tensors) == expected
        assert obj["num_loss_tokens"] == int(mask.sum())


@pytest.mark.engine
@pytest.mark.slow
def test_generated_tokens_are_supervised(client: httpx.Client) -> None:
    conversation = CHAT[:2]  # ends with the user: no assistant turn of its own
    body = {
        "prompts": [{"messages": conversation}],
        "loss": "assistant",
        "max_tokens": 5,
        "include_output_tokens": True,
    }
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    obj = response.json()["objects"][0]
    tensors = stored(client, obj)
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    mask = tensors["loss_mask"].tolist()
    assert len(mask) == prompt_tokens + 4  # the last generated token has no state
    assert mask == [0] * prompt_tokens + [1] * 4
    assert obj["num_loss_tokens"] == 4


@pytest.mark.engine
@pytest.mark.slow
def test_all_and_none(client: httpx.Client) -> None:
    body = {"prompts": ["hello world", {"token_ids": [5, 6, 7]}], "loss": "all"}
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    for obj in response.json()["objects"]:
        assert stored(client, obj)["loss_mask"].tolist() == [1] * obj["num_tokens"]
        assert obj["num_loss_tokens"] == obj["num_tokens"]
    plain = client.post("/extract", json={"prompts": [{"messages": CHAT}]}, headers=AUTH_A)
    obj = plain.json()["objects"][0]
    assert "loss_mask" not in stored(client, obj)
    assert obj["num_loss_tokens"] is None


@pytest.mark.parametrize(
    ("prompt", "loss", "field", "reason"),
    [
        ({"messages": CHAT[:2]}, "assistant", "prompts[1].messages", "supervises no token"),
        ({"messages": CHAT[2:4]}, "last_turn", "prompts[1].messages", "supervises no token"),
        ({"token_ids": [5, 6, 7]}, "assistant", "prompts[1]", "needs a messages prompt"),
    ],
)
def test_refused_masks_name_the_prompt(
    fake_client: httpx.Client,
    fake_served: Served,
    prompt: dict[str, Any],
    loss: str,
    field: str,
    reason: str,
) -> None:
    client, root = fake_client, fake_served.root
    before = objects_under(root, "team-a")
    body = {"prompts": [{"messages": CHAT}, prompt], "loss": loss}
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["field"], error["index"]) == (field, 1)
    assert reason in error["message"]
    assert objects_under(root, "team-a") == before  # nothing ran, nothing stored


# --- the same field on vLLM's OpenAI routes (extra body, as OpenAI's clients send it) ---


def chat(client: httpx.Client, engine: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": served_name(engine), "messages": CHAT, "max_tokens": 1, **fields}
    return client.post("/v1/chat/completions", json=body, headers=AUTH_A)


@pytest.mark.engine
@pytest.mark.slow
def test_chat_completions_store_the_mask_extract_stores(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    tokenizer = local_engine.extractor.tokenizer
    for loss, expected in [
        ("assistant", ["jumps over the lazy dog.\n", "Hidden states.\n"]),
        ("last_turn", ["Hidden states.\n"]),
    ]:
        # vLLM's default add_generation_prompt opens a new assistant turn after the
        # conversation: those tokens are stored, never supervised.
        opened = chat(client, local_engine, loss=loss, return_token_ids=True)
        assert opened.status_code == 200, opened.text
        params = opened.json()["choices"][0]["kv_transfer_params"]
        tensors = stored(client, {"key": params["key"]})
        assert tensors["token_ids"].tolist() == opened.json()["prompt_token_ids"]
        assert supervised_text(tokenizer, tensors) == expected
        assert params["num_loss_tokens"] == int(tensors["loss_mask"].sum())
        assert tokenizer.decode(tensors["token_ids"][-1:].tolist()) == "<|assistant|>"
        assert tensors["loss_mask"][-1] == 0
        # Without it, the tokens and the mask are exactly /extract's.
        closed = chat(client, local_engine, loss=loss, add_generation_prompt=False)
        assert closed.status_code == 200, closed.text
        mine = stored(client, {"key": closed.json()["kv_transfer_params"]["key"]})
        body = {"prompts": [{"messages": CHAT}], "loss": loss}
        theirs = stored(
            client, client.post("/extract", json=body, headers=AUTH_A).json()["objects"][0]
        )
        assert mine["token_ids"].tolist() == theirs["token_ids"].tolist()
        assert mine["loss_mask"].tolist() == theirs["loss_mask"].tolist()
    none = chat(client, local_engine)
    assert none.json()["choices"][0]["kv_transfer_params"]["num_loss_tokens"] is None
    assert "loss_mask" not in stored(client, {"key": none.json()["kv_transfer_params"]["key"]})


@pytest.mark.parametrize(
    ("path", "fields", "reason"),
    [
        ("/v1/chat/completions", {"loss": "every"}, "loss"),
        (
            "/v1/chat/completions",
            {"loss": "assistant", "messages": CHAT[:2]},
            "supervises no token",
        ),
        (  # the final assistant turn left open: not the conversation the mask is made for
            "/v1/chat/completions",
            {"loss": "assistant", "add_generation_prompt": False, "continue_final_message": True},
            "renders differently",
        ),
        ("/v1/completions", {"loss": "last_turn", "prompt": "hello"}, "needs a chat request"),
    ],
)
def test_openai_routes_refuse_a_mask_they_cannot_trust(
    fake_client: httpx.Client, fake_served: Served, path: str, fields: dict[str, Any], reason: str
) -> None:
    client, root = fake_client, fake_served.root
    before = objects_under(root, "team-a")
    body = {"model": fake_served.name, "messages": CHAT, "max_tokens": 1, **fields}
    if path == "/v1/completions":
        del body["messages"]
    response = client.post(path, json=body, headers=AUTH_A)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "loss"
    assert reason in error["message"]
    assert objects_under(root, "team-a") == before  # nothing ran, nothing stored
