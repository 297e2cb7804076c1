"""Probes and descriptive routes: /health, /ready, /metrics, /version, /v1/models."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import AUTH_A, ServerThread

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_health_and_ready(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}


def test_draining_app_is_not_ready_and_refuses_work(local_engine: ServerThread) -> None:
    url = local_engine.serve()
    _, _, app = local_engine.servers[-1]
    app.state.hsx.draining = True  # what SIGTERM does first (service.serve.DrainingServer)
    assert httpx.get(f"{url}/ready").status_code == 503
    assert httpx.get(f"{url}/health").status_code == 200  # alive, just leaving
    submitted = local_engine.extractor.requests_submitted
    response = httpx.post(f"{url}/extract", json={"prompts": ["x"]}, headers=AUTH_A)
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    assert local_engine.extractor.requests_submitted == submitted


def test_models_and_version(client: httpx.Client, local_engine: ServerThread) -> None:
    card = client.get("/v1/models", headers=AUTH_A).json()["data"][0]
    extractor = local_engine.extractor
    assert card.pop("created") > 0  # OpenAI's model object: created, owned_by
    assert card == {
        "id": extractor.info.name,
        "object": "model",
        "owned_by": "hsx",
        "layer_ids": extractor.layer_ids,
        "hidden_size": 128,
        "dtype": "float32",
        "max_model_len": 512,
        "storage_backend": "file",
    }
    import vllm

    import service

    assert client.get("/version", headers=AUTH_A).json() == {
        "version": service.__version__,
        "vllm": vllm.__version__,
    }


def test_metrics_has_vllm_and_hsx_families(client: httpx.Client) -> None:
    client.post("/extract", json={"prompts": [{"token_ids": [4, 5, 6]}]}, headers=AUTH_A)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert any(n.startswith("vllm:") for n in names)
