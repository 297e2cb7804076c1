"""Codecs and layer subsets over HTTP: the request fields, the 422s, ``?decode=true``.

The stored objects need the engine (those tests are marked); what is offered and the
refusals before the engine run on the fake (float32, layers [1, 2, 4], as the engine's).
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
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


def numpy_statistics(states: np.ndarray) -> dict[str, list[float]]:
    """The statistics of ``states`` [tokens, layers, hidden], by numpy in float64."""
    x = states.astype(np.float64)
    return {
        "sum": x.sum(axis=(0, 2)).tolist(),
        "sum_sq": (x * x).sum(axis=(0, 2)).tolist(),
        "sum_abs": np.abs(x).sum(axis=(0, 2)).tolist(),
        "max_abs": np.abs(x).max(axis=(0, 2)).tolist(),
        "sum_token_norm": np.sqrt((x * x).sum(axis=2)).sum(axis=0).tolist(),
        "zero_rows": (np.abs(x).max(axis=2) == 0).sum(axis=0).tolist(),
        "non_finite": (~np.isfinite(x)).sum(axis=(0, 2)).tolist(),
    }


def assert_statistics(stats: dict[str, Any], states: np.ndarray, rtol: float) -> None:
    assert (stats["num_tokens"], stats["hidden_size"]) == (states.shape[0], states.shape[2])
    for name, expected in numpy_statistics(states).items():
        np.testing.assert_allclose(stats[name], expected, rtol=rtol, err_msg=name)


@pytest.mark.engine
@pytest.mark.slow
def test_objects_carry_statistics_and_provenance(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    """Statistics of the states as stored, before a lossy codec; provenance in every
    object's metadata."""
    extractor = local_engine.extractor
    prompts = random_prompts([9, 70], seed=53)
    body = {"prompts": [{"token_ids": p} for p in prompts], "metadata": {"run": "r1"}}
    raw = extract(client, body)["objects"]
    lossy = extract(client, {**body, "codec": "fp8"})["objects"]
    for plain, fp8 in zip(raw, lossy, strict=True):
        stored = client.get(f"/objects/{plain['key']}", headers=AUTH_A).content
        states = load(stored)["hidden_states"].numpy()
        assert_statistics(plain["statistics"], states, rtol=1e-6)
        # fp8: the statistics are the model's states' (the raw object of the same
        # prompt), not the decoded fp8 values'.
        assert_statistics(fp8["statistics"], states, rtol=1e-5)
        encoded = client.get(f"/objects/{fp8['key']}", headers=AUTH_A).content
        decoded = load(codecs.to_raw(encoded))["hidden_states"].numpy().astype(np.float64)
        stats = fp8["statistics"]
        assert not np.allclose(stats["sum_sq"], (decoded**2).sum(axis=(0, 2)), rtol=1e-4)
        for obj, data in ((plain, stored), (fp8, encoded)):
            meta = codecs.read_metadata(data)
            expected = extractor.provenance.metadata(obj["codec"], extractor.dtype)
            assert {k: v for k, v in meta.items() if k.startswith("hsx.provenance.")} == expected
            assert meta["run"] == "r1"
            assert "hsx.provenance.weights_sha256" in meta


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
