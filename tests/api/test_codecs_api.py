"""Codecs and layer subsets over HTTP: the request fields, the 422s, ``?decode=true``.

The stored objects need the engine (those tests are marked); what is offered and the
refusals before the engine run on the fake (float32, layers [1, 2, 4], as the engine's).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from service import codecs
from tests.api.conftest import AUTH_A, CODEC_CHOICES, Served, ServerThread, as_extraction
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import random_prompts
from tests.engine.reference import reference_states

OFFERED = codecs.offered("float32")  # a float32 model: bf16 is offered


def extract(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_models_list_the_codecs_offered(fake_client: httpx.Client) -> None:
    client = fake_client
    card = client.get("/v1/models", headers=AUTH_A).json()["data"][0]
    assert card["codecs"] == OFFERED
    assert card["default_codec"] == "raw"


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("codec", ["lossless", "fp8", "bf16"])
def test_codec_objects_decode_to_raw_over_http(
    client: httpx.Client, local_engine: ServerThread, codec: str
) -> None:
    prompts = random_prompts([6, 120], seed=51)
    data = extract(client, {"prompts": [{"token_ids": p} for p in prompts], "codec": codec})
    assert data["codecs"] == OFFERED
    model, layers = local_engine.settings.engine.model, local_engine.extractor.layer_ids
    for prompt, obj in zip(prompts, data["objects"], strict=True):
        assert obj["codec"] == codec
        stored = client.get(f"/objects/{obj['key']}", headers=AUTH_A).content
        assert len(stored) == obj["bytes"]
        assert codecs.read_metadata(stored)["hsx.codec"] == codec
        response = client.get(f"/objects/{obj['key']}?decode=true", headers=AUTH_A)
        assert response.status_code == 200
        raw = response.content
        assert codecs.read_metadata(raw)["hsx.codec"] == "raw"
        # The server decodes as the client module does (safetensors orders metadata
        # keys at random, so compare what the bytes hold, not the bytes).
        local = codecs.to_raw(stored)
        assert codecs.read_metadata(raw) == codecs.read_metadata(local)
        states = load(raw)["hidden_states"]
        assert torch.equal(states, load(local)["hidden_states"])
        assert states.dtype == torch.float32
        if codec == "lossless":  # exact: the same check as a raw object's
            assert_object_matches(raw, model, prompt, layers, as_extraction(obj))
            continue
        reference = reference_states(model, prompt, layers)
        relative = (states - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert relative.max() <= (0.03 if codec == "fp8" else 0.005)


@pytest.mark.engine
@pytest.mark.slow
def test_decode_of_a_raw_object_is_the_object_itself(client: httpx.Client) -> None:
    key = extract(client, {"prompts": [{"token_ids": [5, 6, 7]}]})["objects"][0]["key"]
    plain = client.get(f"/objects/{key}", headers=AUTH_A).content
    assert client.get(f"/objects/{key}?decode=true", headers=AUTH_A).content == plain
    missing = key.replace(".safetensors", "0.safetensors")
    assert client.get(f"/objects/{missing}?decode=true", headers=AUTH_A).status_code == 404


@pytest.mark.engine
@pytest.mark.slow
def test_layers_field_stores_those_layers(client: httpx.Client, local_engine: ServerThread) -> None:
    served = local_engine.extractor.layer_ids
    prompt = random_prompts([40], seed=52)[0]
    data = extract(
        client, {"prompts": [{"token_ids": prompt}], "layers": served[-1:], "codec": "fp8"}
    )
    assert data["layer_ids"] == served[-1:]
    obj = data["objects"][0]
    assert obj["shape"] == [40, 1, 128]
    raw = client.get(f"/objects/{obj['key']}?decode=true", headers=AUTH_A).content
    assert load(raw)["hidden_states"].shape == (40, 1, 128)
    assert codecs.read_metadata(raw)["layer_ids"] == str(served[-1:])


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (name, extra body, field, text the message must hold)
    ("unknown codec", {"codec": "zfp"}, "codec", CODEC_CHOICES),
    ("codec not a string", {"codec": 8}, "codec", CODEC_CHOICES),
    ("layer not served", {"layers": [3]}, "layers", "served layer ids [1, 2, 4]"),
    ("layers out of order", {"layers": [4, 1]}, "layers", "served layer ids [1, 2, 4]"),
    ("layers repeated", {"layers": [1, 1]}, "layers", "served layer ids [1, 2, 4]"),
    ("no layers", {"layers": []}, "layers", "at least 1"),
    ("negative layer", {"layers": [-1]}, "layers[0]", "greater than or equal to 0"),
]


@pytest.mark.parametrize(("name", "extra", "field", "text"), BAD, ids=[b[0] for b in BAD])
def test_bad_codec_or_layers_are_422_before_the_engine(
    fake_client: httpx.Client, fake_served: Served, name: str, extra: Any, field: str, text: str
) -> None:
    client, engine_requests = fake_client, fake_served.engine_requests
    submitted = engine_requests()
    body = {"prompts": [{"token_ids": [5, 6, 7]}], **extra}
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["field"] == field
    assert error["message"].startswith(f"{field}: ")
    assert text in error["message"]
    assert engine_requests() == submitted
