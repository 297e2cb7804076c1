"""``regenerate`` attacked in process (the fake engine: real tokenizer and chat
template, real local storage, deterministic answers): every bad field is a 422 naming
it, a bad conversation fails alone with nothing stored and nothing generated, odd text
never breaks the server, and concurrent retries of one custom_id generate it once."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.auth import ApiKeys
from service.masks import render_text
from tests.api.conftest import AUTH_A, KEYS, fast_settings
from tests.api.fake import fake_extractor, list_objects, serving_in_process

GOOD = [{"role": "user", "content": "Hello there"}]


def body(prompts: list[Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"prompts": prompts or [{"messages": GOOD}], "regenerate": True, **fields}


async def test_single_turn_answer_is_the_engines_ids(app_client: httpx.AsyncClient, fake: Any):
    response = await app_client.post("/extract", json=body(loss="assistant"), headers=AUTH_A)
    assert response.status_code == 200, response.text
    (obj,) = response.json()["objects"]
    info = obj["regenerated"]
    opened = fake.tokenizer.encode(
        render_text(fake.tokenizer, GOOD, add_generation_prompt=True), add_special_tokens=False
    )
    (turn,) = info["turns"]
    ids = info["token_ids"]
    assert ids[: turn["start"]] == opened
    assert turn["start"] == len(opened)
    answer = ids[turn["start"] : turn["start"] + turn["generated"]]
    assert answer[-1] == fake.tokenizer.eos_token_id
    assert turn["finish_reason"] == "stop"
    assert ids[turn["start"] + turn["generated"] : turn["end"]] == fake.tokenizer.encode(
        "\n", add_special_tokens=False
    )
    assert obj["num_tokens"] == len(ids)
    assert info["messages"][:1] == GOOD
    assert info["messages"][1]["role"] == "assistant"
    assert fake.generations == 1


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"regenerate": {"max_tokens": 10**30}}, "regenerate.max_tokens"),
        ({"regenerate": {"max_tokens": 65}}, "regenerate.max_tokens"),
        ({"regenerate": {"max_tokens": 0}}, "regenerate.max_tokens"),
        ({"regenerate": {"max_tokens": "8"}}, "regenerate.max_tokens"),
        ({"regenerate": {"seed": 1.5}}, "regenerate.seed"),
        ({"regenerate": {"seed": -1}}, "regenerate.seed"),
        ({"regenerate": {"seed": 1 << 64}}, "regenerate.seed"),
        ({"regenerate": {"top_p": 0}}, "regenerate.top_p"),
        ({"regenerate": {"temperature": "0"}}, "regenerate.temperature"),
        ({"regenerate": {"temperature": 0.7}}, "regenerate.temperature"),  # CPU: no seeded sampling
        ({"regenerate": {"nope": 1}}, "regenerate.nope"),
        ({"regenerate": "yes"}, "regenerate"),
        ({"regenerate": []}, "regenerate"),
        ({"include_output_tokens": True}, "include_output_tokens"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"return": "inline"}, "return"),
        ({"loss": "last_turn"}, "loss"),
        ({"metadata": {"hsx.regenerate": "{}"}}, "metadata"),
        ({"prompts": ["plain text"]}, "prompts[0]"),
        ({"prompts": [{"token_ids": [5, 6]}]}, "prompts[0]"),
        ({"prompts": [{"messages": []}]}, "prompts[0].messages"),
    ],
)
async def test_bad_fields_are_refused_by_name(
    app_client: httpx.AsyncClient, fake: Any, tmp_path: Path, fields: dict[str, Any], field: str
) -> None:
    response = await app_client.post("/extract", json=body(**fields), headers=AUTH_A)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert field in (error.get("field") or "") + error["message"], error
    assert fake.generations == 0
    assert not list_objects(tmp_path / "objects", "team-a")


@pytest.mark.parametrize(
    "text",
    ["", "\u0000", "\u202eevil\u202c", "😀" * 50, "\ud800", "a\r\nb\tc", "<|assistant|>x"],
    ids=["empty", "nul", "bidi", "emoji", "lone-surrogate", "controls", "special-token-text"],
)
async def test_odd_text_is_answered_or_refused_never_broken(
    app_client: httpx.AsyncClient, fake: Any, tmp_path: Path, text: str
) -> None:
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text + "?"}]
    raw = json.dumps(body([{"messages": messages}]))  # "\ud800" travels escaped
    response = await app_client.post(
        "/extract", content=raw, headers={**AUTH_A, "Content-Type": "application/json"}
    )
    assert response.status_code in (200, 422), response.text
    stored = list_objects(tmp_path / "objects", "team-a")
    assert len(stored) == (1 if response.status_code == 200 else 0)
    health = await app_client.get("/health")
    assert health.status_code == 200


async def test_concurrent_retries_of_a_custom_id_generate_it_once(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    messages = [*GOOD, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    prompt = {"messages": messages, "custom_id": "same-row"}
    answers = await asyncio.gather(
        *(app_client.post("/extract", json=body([prompt]), headers=AUTH_A) for _ in range(8))
    )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    objects = [a.json()["objects"][0] for a in answers]
    assert len({o["key"] for o in objects}) == 1
    assert len({json.dumps(o["regenerated"]["token_ids"]) for o in objects}) == 1
    assert fake.generations == 2  # two turns, generated once
    assert sum(o["status"] == "created" for o in objects) == 1


@pytest.fixture
def strict_template(tokenizer_dir: Path, tmp_path: Path) -> Path:
    """The tiny tokenizer with a template that knows no tool turns (as many don't)."""
    out = tmp_path / "strict"
    shutil.copytree(tokenizer_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool turns are not supported') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "no user"),
        (
            [*GOOD, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "{}"}],
            "tool turns are not supported",
        ),
    ],
    ids=["no-user-turn", "tool-turn-template-cannot-render"],
)
async def test_bad_conversation_fails_alone_with_nothing_stored(
    strict_template: Path, tmp_path: Path, messages: list[dict[str, str]], words: str
) -> None:
    fake = fake_extractor(tmp_path / "objects", strict_template)
    keys: ApiKeys = KEYS
    async with serving_in_process(fast_settings(tmp_path), fake, keys) as (_, client):
        prompts = [{"messages": GOOD}, {"messages": messages}]
        response = await client.post("/extract", json=body(prompts), headers=AUTH_A)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["index"] == 1
    assert error["field"] == "prompts[1].messages"
    assert words in error["message"]
    assert fake.generations == 0
    assert not list_objects(tmp_path / "objects", "team-a")
