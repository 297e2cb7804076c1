"""Chat templates a loss mask cannot be trusted with, refused by ``/extract`` before the
engine (fast: the fake extractor with the tiny model's real tokenizer, whose template
each test replaces)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import AUTH_A
from tests.api.fake import list_objects

CHAT = [
    {"role": "user", "content": "The quick brown fox?"},
    {"role": "assistant", "content": "jumps over the lazy dog."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Hidden states."},
]
TURNS = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        # The message count first: every render's prefix changes with the history.
        ("{{ messages | length }}" + TURNS, "not prefix-stable"),
        # A clock in the template: no two renders agree, whichever check meets it first.
        ("{{ strftime_now('%H:%M:%S.%f') }}" + TURNS, "chat template"),
    ],
)
async def test_an_untrustworthy_template_gets_422_and_no_engine_work(
    app_client: httpx.AsyncClient, fake: Any, template: str, reason: str
) -> None:
    fake.tokenizer.chat_template = template
    for loss in ("assistant", "last_turn"):
        body = {"prompts": [{"messages": CHAT}], "loss": loss}
        response = await app_client.post("/extract", json=body, headers=AUTH_A)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (error["field"], error["index"]) == ("prompts[0].messages", 0)
        assert reason in error["message"]
    assert fake.submitted == 0
    assert list_objects(fake.storage.root, "team-a") == set()
    # The same conversation without a mask is fine: only the mask is refused.
    ok = await app_client.post("/extract", json={"prompts": [{"messages": CHAT}]}, headers=AUTH_A)
    assert ok.status_code == 200, ok.text
