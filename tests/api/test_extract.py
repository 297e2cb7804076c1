"""POST /extract end to end: real uvicorn, real engine, objects on local disk."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import load

from tests.api.conftest import AUTH_A, AUTH_B, ServerThread, as_extraction, objects_under
from tests.engine.checks import assert_object_matches, object_metadata
from tests.engine.conftest import random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_extract_token_ids_text_and_messages(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    ids = random_prompts([5, 70, 300], seed=21)
    body = {
        "prompts": [
            {"token_ids": ids[0]},
            {"token_ids": ids[1]},
            "hello world, hidden states",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "ok"},
                ]
            },
            {"token_ids": ids[2]},
        ],
        "metadata": {"dataset": "unit"},
    }
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    data = response.json()
    extractor = local_engine.extractor
    assert data["layer_ids"] == extractor.layer_ids
    assert data["hidden_size"] == 128
    assert data["dtype"] == "float32"
    assert [o["index"] for o in data["objects"]] == [0, 1, 2, 3, 4]
    tokenizer = extractor.tokenizer
    expected_ids = [
        ids[0],
        ids[1],
        tokenizer.encode("hello world, hidden states"),
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                tokenize=False,
            ),
            add_special_tokens=False,
        ),
        ids[2],
    ]
    model = extractor.settings.engine.model
    for obj, token_ids in zip(data["objects"], expected_ids, strict=True):
        assert obj["key"].startswith("hsx/team-a/")
        path = local_engine.root / obj["key"]  # type: ignore[attr-defined]
        assert path.stat().st_size == obj["bytes"]
        assert obj["uri"] == path.as_uri()
        assert obj["shape"] == [len(token_ids), len(data["layer_ids"]), 128]
        # Round trip through GET /objects: the same bytes as on disk.
        fetched = client.get(f"/objects/{obj['key']}", headers=AUTH_A)
        assert fetched.status_code == 200
        assert fetched.content == path.read_bytes()
        assert_object_matches(
            fetched.content, model, token_ids, data["layer_ids"], as_extraction(obj)
        )
        assert object_metadata(fetched.content)["dataset"] == "unit"
    total = sum(len(t) for t in expected_ids)
    assert data["usage"] == {"prompt_tokens": total, "total_tokens": total + 5}


def test_include_output_tokens_over_http(client: httpx.Client, local_engine: ServerThread) -> None:
    prompt = random_prompts([30], seed=22)[0]
    body = {"prompts": [{"token_ids": prompt}], "max_tokens": 5, "include_output_tokens": True}
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    obj = response.json()["objects"][0]
    tensors = load(client.get(f"/objects/{obj['key']}", headers=AUTH_A).content)
    stored = tensors["token_ids"].tolist()
    assert stored[:30] == prompt
    assert len(stored) == 30 + 4  # the last generated token has no state
    assert response.json()["usage"] == {"prompt_tokens": 30, "total_tokens": 35}


def test_namespaces_are_isolated(client: httpx.Client, local_engine: ServerThread) -> None:
    response = client.post("/extract", json={"prompts": [{"token_ids": [5, 6, 7]}]}, headers=AUTH_B)
    key = response.json()["objects"][0]["key"]
    assert key.startswith("hsx/team-b/")
    assert client.get(f"/objects/{key}", headers=AUTH_A).status_code == 404
    assert client.delete(f"/objects/{key}", headers=AUTH_A).status_code == 404
    assert client.get(f"/objects/{key}", headers=AUTH_B).status_code == 200
    assert client.delete(f"/objects/{key}", headers=AUTH_B).status_code == 204
    assert client.get(f"/objects/{key}", headers=AUTH_B).status_code == 404
    assert client.delete(f"/objects/{key}", headers=AUTH_B).status_code == 404
    assert key not in objects_under(local_engine.root, "team-b")  # type: ignore[attr-defined]
