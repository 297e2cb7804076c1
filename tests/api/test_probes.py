"""Probes and descriptive routes: /health, /ready, /metrics, /version, /v1/models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service import codecs
from tests.api.conftest import AUTH_A, KEYS, ServerThread, fast_settings
from tests.api.fake import serving_in_process


@pytest.mark.engine
@pytest.mark.slow
def test_health_and_ready(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}


async def test_draining_app_is_not_ready_and_refuses_work(fake: Any, tmp_path: Path) -> None:
    async with serving_in_process(fast_settings(tmp_path), fake, KEYS) as (app, client):
        app.state.hsx.draining = True  # what SIGTERM does first (service.serve.DrainingServer)
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/health")).status_code == 200  # alive, just leaving
        response = await client.post("/extract", json={"prompts": ["x"]}, headers=AUTH_A)
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    assert fake.submitted == 0


@pytest.mark.engine
@pytest.mark.slow
def test_models_and_version(client: httpx.Client, local_engine: ServerThread) -> None:
    import hashlib

    card = client.get("/v1/models", headers=AUTH_A).json()["data"][0]
    extractor = local_engine.extractor
    template = extractor.tokenizer.chat_template
    assert card.pop("chat_template_sha256") == hashlib.sha256(template.encode()).hexdigest()
    tokenizer_json = extractor.tokenizer.backend_tokenizer.to_str()
    assert card.pop("tokenizer_sha256") == hashlib.sha256(tokenizer_json.encode()).hexdigest()
    assert card.pop("created") > 0  # OpenAI's model object: created, owned_by
    # The weights' SHA-256: sha256sum's lines over the weight files, by name.
    model = Path(str(local_engine.settings.engine.model))
    lines = "".join(
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
        for f in sorted(model.glob("*.safetensors"))
    )
    provenance = card.pop("provenance")
    assert provenance["weights_sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert provenance["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert provenance == extractor.provenance.fields("raw", "float32")
    assert {"hsx_version", "vllm_version", "torch_version", "layer_convention"} <= set(provenance)
    # The KV capacity per rank (its numbers are checked in test_metrics): the whole
    # cache's bytes over the tokens, at least one full sequence.
    capacity = card.pop("kv_cache")
    assert capacity["tokens"] >= 512
    assert capacity["bytes_per_token"] == capacity["memory_bytes"] // capacity["tokens"]
    assert 0 < capacity["hidden_state_memory_bytes"] < capacity["memory_bytes"]
    assert card == {
        "id": "llama",  # the served name, not the server's path
        "object": "model",
        "owned_by": "hsx",
        "layer_ids": extractor.layer_ids,
        "hidden_size": 128,
        "dtype": "float32",
        "max_model_len": 512,
        "storage_backend": "file",
        "codecs": codecs.offered("float32"),
        "default_codec": "raw",
    }
    import vllm

    import service

    assert client.get("/version", headers=AUTH_A).json() == {
        "version": service.__version__,
        "vllm": vllm.__version__,
    }


@pytest.mark.engine
@pytest.mark.slow
def test_metrics_has_vllm_and_hsx_families(client: httpx.Client) -> None:
    client.post("/extract", json={"prompts": [{"token_ids": [4, 5, 6]}]}, headers=AUTH_A)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert any(n.startswith("vllm:") for n in names)
