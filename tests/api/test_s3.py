"""End to end on S3 (moto on 127.0.0.1) with the hybrid model: keys, bytes, exactness."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import httpx
import pytest

from tests.api.conftest import AUTH_A, AUTH_B, ServerThread, as_extraction
from tests.conftest import s3_settings
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings, random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]
BUCKET = "hsx-api"


@pytest.fixture(scope="module")
def s3_engine(model_dir: Any, s3_endpoint: str) -> Iterator[ServerThread]:
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket=BUCKET
    )
    storage = s3_settings(s3_endpoint, BUCKET, prefix="runs").model_dump()
    settings = engine_settings(model_dir("nemotron-h"), storage.pop("url"), storage=storage)
    thread = ServerThread(settings)
    yield thread
    thread.close()


def test_hybrid_on_s3_over_http(s3_engine: ServerThread, s3_admin: Any) -> None:
    url = s3_engine.serve()
    prompts = random_prompts([9, 65, 140], seed=41)
    body = {"prompts": [{"token_ids": p} for p in prompts], "max_tokens": 3}
    with httpx.Client(base_url=url, timeout=120) as client:
        assert client.get("/ready").json() == {"status": "ready"}
        models = client.get("/v1/models", headers=AUTH_A).json()["data"][0]
        assert models["storage_backend"] == "s3"
        response = client.post("/extract", json=body, headers=AUTH_A)
        assert response.status_code == 200, response.text
        model = s3_engine.settings.engine.model
        assert model is not None
        for obj, prompt in zip(response.json()["objects"], prompts, strict=True):
            assert obj["uri"] == f"s3://{BUCKET}/runs/{obj['key']}"
            stored = s3_admin.get_object(Bucket=BUCKET, Key=f"runs/{obj['key']}")["Body"].read()
            assert len(stored) == obj["bytes"]
            # GET redirects to a presigned URL on the store itself; following it gives
            # the same bytes.
            redirect = client.get(f"/objects/{obj['key']}", headers=AUTH_A)
            assert redirect.status_code == 307
            assert redirect.headers["location"].startswith(
                f"{s3_engine.settings.storage.s3.endpoint_url}/"
            )
            assert httpx.get(redirect.headers["location"], timeout=30).content == stored
            assert_object_matches(
                stored, model, prompt, response.json()["layer_ids"], as_extraction(obj)
            )
        key = response.json()["objects"][0]["key"]
        assert client.get(f"/objects/{key}", headers=AUTH_B).status_code == 404
        assert client.delete(f"/objects/{key}", headers=AUTH_A).status_code == 204
        listed = s3_admin.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{key}")
        assert listed.get("KeyCount", 0) == 0


def test_hybrid_layout_matches_the_engine(s3_engine: ServerThread) -> None:
    from tests.api.test_metrics import assert_layout_matches, scrape

    url = s3_engine.serve()
    assert_layout_matches(url, s3_engine)
    kinds = sorted(
        dict(labels)["kind"]
        for (name, labels), _ in scrape(url).items()
        if name == "hsx_kv_cache_group_info"
    )
    assert kinds == ["full_attention", "hidden_state", "mamba", "mamba"]


def test_s3_lossless_object_decodes_over_http(s3_engine: ServerThread, s3_admin: Any) -> None:
    """``?decode=true`` reads the object from S3 and answers it as a raw object."""
    from service import codecs

    url = s3_engine.serve()
    prompt = random_prompts([70], seed=42)[0]
    body = {"prompts": [{"token_ids": prompt}], "codec": "lossless"}
    with httpx.Client(base_url=url, timeout=120) as client:
        obj = client.post("/extract", json=body, headers=AUTH_A).json()["objects"][0]
        stored = s3_admin.get_object(Bucket=BUCKET, Key=f"runs/{obj['key']}")["Body"].read()
        assert codecs.read_metadata(stored)["hsx.codec"] == "lossless"
        decoded = client.get(f"/objects/{obj['key']}?decode=true", headers=AUTH_A)
    assert decoded.status_code == 200
    model = s3_engine.settings.engine.model
    assert model is not None
    layers = s3_engine.extractor.layer_ids
    assert_object_matches(decoded.content, model, prompt, layers, as_extraction(obj))
