"""``codec`` and ``layers`` in the extra body of the OpenAI routes, through the official
``openai`` client: the objects they store, and their refusals before the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from service import codecs
from tests.api.conftest import AUTH_A, CODEC_CHOICES, Served, ServerThread, as_extraction
from tests.api.openai_helpers import counter
from tests.api.openai_helpers import served_name as model_name
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import random_prompts
from tests.engine.reference import reference_states

CHAT = [{"role": "user", "content": "The quick brown fox?"}]
# The stored objects need the engine (marked so); the refusals before it run on the fake.


@pytest.mark.engine
@pytest.mark.slow
def test_completion_with_fp8_codec_stores_fp8_objects(
    sync_client: Any, local_engine: ServerThread
) -> None:
    ids = random_prompts([30, 90], seed=61)
    result = sync_client.completions.create(
        model=model_name(local_engine), prompt=ids, max_tokens=1, extra_body={"codec": "fp8"}
    )
    model, layers = local_engine.settings.engine.model, local_engine.extractor.layer_ids
    for choice, token_ids in zip(result.choices, ids, strict=True):
        params = choice.model_extra["kv_transfer_params"]
        assert params["codec"] == "fp8"
        assert params["shape"] == [len(token_ids), len(layers), 128]
        stored = Path(params["hidden_states_path"]).read_bytes()
        assert len(stored) == params["bytes"]
        assert codecs.read_metadata(stored)["hsx.codec"] == "fp8"
        tensors = load(stored)
        assert tensors["hidden_states"].dtype == torch.float8_e4m3fn
        assert tensors["hidden_states_scales"].shape == (len(token_ids), len(layers), 1)
        assert tensors["token_ids"].tolist() == token_ids
        states = load(codecs.to_raw(stored))["hidden_states"]
        reference = reference_states(model, token_ids, layers)
        relative = (states - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert relative.max() <= 0.03


@pytest.mark.engine
@pytest.mark.slow
def test_chat_with_layers_and_lossless_stores_that_subset(
    sync_client: Any, client: httpx.Client, local_engine: ServerThread
) -> None:
    served = local_engine.extractor.layer_ids
    subset = [served[0], served[-1]]
    result = sync_client.chat.completions.create(
        model=model_name(local_engine),
        messages=CHAT,
        max_tokens=1,
        extra_body={"layers": subset, "codec": "lossless", "return_token_ids": True},
    )
    token_ids = result.model_extra["prompt_token_ids"]
    params = result.model_extra["kv_transfer_params"]
    assert params["codec"] == "lossless"
    assert params["shape"] == [len(token_ids), 2, 128]
    stored = client.get(f"/objects/{params['handle']}", headers=AUTH_A).content
    metadata = codecs.read_metadata(stored)
    assert metadata["hsx.codec"] == "lossless"
    raw = codecs.to_raw(stored)
    assert codecs.read_metadata(raw)["layer_ids"] == str(subset)
    model = local_engine.settings.engine.model
    assert_object_matches(raw, model, token_ids, subset, as_extraction(params))


@pytest.mark.engine
@pytest.mark.slow
def test_default_codec_is_named_in_transfer_params(
    sync_client: Any, local_engine: ServerThread
) -> None:
    result = sync_client.completions.create(
        model=model_name(local_engine), prompt=[5, 6, 7], max_tokens=1
    )
    params = result.choices[0].model_extra["kv_transfer_params"]
    assert params["codec"] == "raw"
    stored = Path(params["hidden_states_path"]).read_bytes()
    assert codecs.read_metadata(stored)["hsx.codec"] == "raw"


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (name, extra body, param, text the message must hold)
    ("unknown codec", {"codec": "zfp"}, "codec", CODEC_CHOICES),
    ("codec not a string", {"codec": 8}, "codec", CODEC_CHOICES),
    ("layer not served", {"layers": [3]}, "layers", "served layer ids [1, 2, 4]"),
    ("layers out of order", {"layers": [4, 1]}, "layers", "served layer ids [1, 2, 4]"),
    ("no layers", {"layers": []}, "layers", "at least 1"),
    ("layers not a list", {"layers": 4}, "layers", "valid list"),
    ("negative layer", {"layers": [1, -1]}, "layers[1]", "greater than or equal to 0"),
    ("layer a string", {"layers": ["1"]}, "layers[0]", "valid integer"),
]
ROUTES = [
    ("/v1/completions", {"prompt": [5, 6, 7]}),
    ("/v1/chat/completions", {"messages": CHAT}),
]


@pytest.mark.parametrize(("path", "prompt"), ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize(("name", "extra", "param", "text"), BAD, ids=[b[0] for b in BAD])
def test_bad_codec_or_layers_are_400_before_the_engine(
    fake_client: httpx.Client,
    fake_served: Served,
    name: str,
    extra: dict[str, Any],
    param: str,
    text: str,
    path: str,
    prompt: dict[str, Any],
) -> None:
    client, local_url, engine_requests = fake_client, fake_served.url, fake_served.engine_requests
    engine, prompts = engine_requests(), counter(local_url, "hsx_extract_prompts_total")
    response = client.post(path, json={**prompt, **extra}, headers=AUTH_A)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    assert text in error["message"]
    assert engine_requests() == engine
    assert counter(local_url, "hsx_extract_prompts_total") == prompts
