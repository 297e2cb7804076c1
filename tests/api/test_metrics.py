"""Metrics after a known workload, KV layout against the engine, dashboards and names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import AUTH_A, AUTH_FLAKY, ServerThread
from tests.engine.conftest import random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]
DASHBOARDS = sorted(
    (Path(__file__).resolve().parents[2] / "deploy/helm/hsx/dashboards").glob("*.json")
)
KINDS = {
    "FullAttentionSpec": "full_attention",
    "SlidingWindowSpec": "sliding_window",
    "MambaSpec": "mamba",
    "HiddenStateCacheSpec": "hidden_state",
}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def delta(after: dict[Any, float], before: dict[Any, float], name: str, **labels: str) -> float:
    """How much a series grew (a labelled series may not exist before its first event)."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counters_equal_the_workload(local_engine: ServerThread) -> None:
    url = local_engine.serve(max_queued_prompts=6)  # a fresh app: its counters start at 0
    # Storage and writer metrics are the shared extractor's: compare against now.
    before = scrape(url)
    sizes, tokens = 0, 0
    with httpx.Client(base_url=url, timeout=120) as client:
        for lengths in ([10, 20], [30], [5, 6, 7]):
            body = {"prompts": [{"token_ids": p} for p in random_prompts(lengths, seed=51)]}
            data = client.post("/extract", json=body, headers=AUTH_A).json()
            sizes += sum(o["bytes"] for o in data["objects"])
            tokens += sum(o["num_tokens"] for o in data["objects"])
        flaky = {"prompts": [{"token_ids": p} for p in random_prompts([4, 5], seed=52)]}
        flaky_reply = client.post("/extract", json=flaky, headers=AUTH_FLAKY).json()
        written = [o for o in flaky_reply["objects"] if "key" in o]
        tokens += 4
        sizes += (tmp := local_engine.root / written[0]["key"]).stat().st_size  # type: ignore[attr-defined]
        assert tmp.is_file()
        assert (
            client.post("/extract", json={"prompts": ["x"] * 7}, headers=AUTH_A).status_code == 429
        )
        assert client.post("/extract", json={"prompts": []}, headers=AUTH_A).status_code == 422
        assert client.post("/extract", json={"prompts": ["x"]}).status_code == 401
    samples = scrape(url)
    assert value(samples, "hsx_extract_requests_total", outcome="ok") == 3
    assert value(samples, "hsx_extract_requests_total", outcome="storage_error") == 1
    rejections = {k: v for k, v in samples.items() if k[0] == "hsx_extract_rejections_total"}
    assert value(samples, "hsx_extract_requests_total", outcome="rejected") == 3, rejections
    assert value(samples, "hsx_extract_prompts_total", outcome="ok") == 7
    assert value(samples, "hsx_extract_prompts_total", outcome="failed") == 1
    assert value(samples, "hsx_extract_tokens_total") == tokens
    assert value(samples, "hsx_extract_written_bytes_total", backend="file") == sizes
    assert value(samples, "hsx_extract_rejections_total", reason="overloaded") == 1
    assert value(samples, "hsx_extract_rejections_total", reason="invalid_request") == 1
    assert value(samples, "hsx_extract_rejections_total", reason="unauthorized") == 1
    assert value(samples, "hsx_extract_duration_seconds_count") == 4
    assert value(samples, "hsx_extract_copy_duration_seconds_count") == 7
    # The worker's failed put, seen by the worker's instrumented storage.
    errors = {"backend": "file", "operation": "put", "kind": "error"}
    assert delta(samples, before, "hsx_storage_errors_total", **errors) == 1
    assert value(samples, "hsx_writer_bytes_in_flight_limit_bytes") == (
        local_engine.settings.limits.max_bytes_in_flight
    )
    assert value(samples, "hsx_extract_prompts_in_flight") == 0
    assert value(samples, "hsx_writer_bytes_in_flight_bytes") == 0  # idle again
    # The served name only: no server path, no versions on a public route.
    assert value(samples, "hsx_build_info", model="llama") == 1


def test_every_recorded_outcome_is_pre_registered(local_url: str) -> None:
    """The outcome labels the code records exist (at 0) before the first request."""
    from service.api.outcomes import outcome_of
    from service.engine import errors

    exported = {
        dict(labels)["outcome"]
        for name, labels in scrape(local_url)
        if name == "hsx_extract_requests_total"
    }
    failures = [
        errors.EngineUnavailableError("x"),
        errors.StorageFullError("x"),
        errors.StorageWriteError("x"),
        errors.InvalidStatesError("x", "non_finite"),
        errors.ExtractionError("x"),
        errors.IdempotencyConflictError("x"),
        errors.InvalidPromptError("x"),
    ]
    assert {type(e) for e in failures} == set(errors.FAILURES)  # a new error joins here
    recorded = {"ok", "rejected", "timeout", "disconnected"}
    recorded |= {outcome_of([error]) for error in failures}
    assert recorded == exported


def test_storage_metrics_equal_the_work_on_local_disk(local_engine: ServerThread) -> None:
    """Puts (in the worker) and GET /objects reads (in the API) are all counted."""
    url = local_engine.serve()
    before = scrape(url)
    prompts = random_prompts([3, 8, 21, 34, 55], seed=61)
    with httpx.Client(base_url=url, timeout=120) as client:
        body = {"prompts": [{"token_ids": p} for p in prompts]}
        objects = client.post("/extract", json=body, headers=AUTH_A).json()["objects"]
        sizes = [(local_engine.root / o["key"]).stat().st_size for o in objects]  # type: ignore[attr-defined]
        assert sizes == [o["bytes"] for o in objects]
        for o in objects:
            read = client.get(f"/objects/{o['key']}", headers=AUTH_A)
            assert read.status_code == 200
            assert len(read.content) == o["bytes"]
        assert client.delete(f"/objects/{objects[0]['key']}", headers=AUTH_A).status_code == 204
    after = scrape(url)
    file = {"backend": "file"}
    count = "hsx_storage_operation_duration_seconds_count"
    assert delta(after, before, count, operation="put", **file) == len(prompts)
    assert delta(after, before, "hsx_storage_written_bytes_total", **file) == sum(sizes)
    assert delta(after, before, count, operation="get", **file) == len(prompts)
    assert delta(after, before, "hsx_storage_read_bytes_total", **file) == sum(sizes)
    assert delta(after, before, count, operation="delete", **file) == 1
    assert delta(after, before, "hsx_storage_retries_total", **file) == 0
    assert value(after, "hsx_writer_bytes_in_flight_bytes") == 0


def expected_layout(raw: dict[str, Any]) -> dict[str, Any]:
    """The layout metrics recomputed from the engine's raw KVCacheConfig."""
    return {
        "groups": len(raw["groups"]),
        "blocks": raw["num_blocks"],
        "per_group": [
            (g["block_size"], len(g["layer_names"]), g["page_size_bytes"]) for g in raw["groups"]
        ],
    }


def assert_layout_matches(url: str, engine: ServerThread) -> None:
    raw = engine.call(engine.extractor.on_workers("hsx_kv_config"))[0]
    samples = scrape(url)
    want = expected_layout(raw)
    assert value(samples, "hsx_kv_cache_groups", engine="0") == want["groups"]
    assert value(samples, "hsx_kv_cache_blocks", engine="0") == want["blocks"]
    assert want["blocks"] == engine.extractor.engine.vllm_config.cache_config.num_gpu_blocks
    infos = {
        dict(labels)["group"]: dict(labels)
        for (name, labels), _ in samples.items()
        if name == "hsx_kv_cache_group_info"
    }
    for index, (block_size, layers, page) in enumerate(want["per_group"]):
        info = infos[str(index)]
        assert (int(info["block_size"]), int(info["layers"])) == (block_size, layers)
        assert (
            value(samples, "hsx_kv_cache_group_page_size_bytes", engine="0", group=str(index))
            == page
        )
    # Memory: what the worker allocated, seen the same way by both families.
    allocated = value(samples, "hsx_kv_cache_memory_bytes", engine="0")
    assert allocated > 0
    assert (
        value(samples, "hsx_memory_kv_cache_bytes", device="cpu", engine="0", rank="0") == allocated
    )
    assert value(samples, "hsx_memory_model_weights_bytes", device="cpu", engine="0", rank="0") > 0
    # /v1/models states the same capacity, as vLLM counts tokens.
    card = httpx.get(f"{url}/v1/models", headers=AUTH_A, timeout=30).json()["data"][0]
    smallest = min(block_size for block_size, _, _ in want["per_group"])
    assert card["kv_cache"]["tokens"] == want["blocks"] // want["groups"] * smallest
    assert card["kv_cache"]["memory_bytes"] == allocated
    assert card["kv_cache"]["hidden_state_memory_bytes"] == value(
        samples, "hsx_kv_cache_hidden_state_memory_bytes", engine="0"
    )
    total = value(samples, "hsx_memory_total_bytes", device="cpu", engine="0", rank="0")
    assert total == value(
        samples, "hsx_memory_used_bytes", device="cpu", engine="0", rank="0"
    ) + value(samples, "hsx_memory_free_bytes", device="cpu", engine="0", rank="0")
    return None


def test_dense_layout_matches_the_engine(local_url: str, local_engine: ServerThread) -> None:
    assert_layout_matches(local_url, local_engine)
    samples = scrape(local_url)
    kinds = {
        dict(labels)["kind"]
        for (name, labels), _ in samples.items()
        if name == "hsx_kv_cache_group_info"
    }
    assert kinds == {"full_attention+hidden_state"}  # one uniform group: 4 attention + 1
    # The hidden-state layer's share: block_size x len(layer_ids) x hidden x 4 bytes.
    extractor = local_engine.extractor
    raw = local_engine.call(extractor.on_workers("hsx_kv_config"))[0]
    block = raw["groups"][0]["block_size"]
    expected = raw["num_blocks"] * block * len(extractor.layer_ids) * 128 * 4
    assert value(samples, "hsx_kv_cache_hidden_state_memory_bytes", engine="0") == expected


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_metrics_are_exported(dashboard: Path, local_url: str) -> None:
    httpx.post(
        f"{local_url}/extract",
        json={"prompts": [{"token_ids": [1, 2, 3]}]},
        headers=AUTH_A,
        timeout=60,
    )
    document = json.loads(dashboard.read_text())
    exprs = [t["expr"] for p in document["panels"] for t in p.get("targets", [])]
    variables = [v.get("definition", "") for v in document["templating"]["list"]]
    used = set()
    for text in exprs + variables:
        used |= set(re.findall(r"\b(?:hsx_|vllm:)[a-zA-Z0-9_:]+", text))
    assert len(used) >= 15
    exported = {name for name, _ in scrape(local_url)}
    missing = sorted(used - exported)
    assert missing == [], missing
    assert all("$__rate_interval" in e for e in exprs if "rate(" in e)
    assert {v["name"] for v in document["templating"]["list"]} >= {
        "datasource",
        "job",
        "instance",
        "model",
    }


ALLOWED_LABELS = {
    "backend",
    "operation",
    "kind",
    "outcome",
    "reason",
    "group",
    "device",
    "engine",  # data-parallel rank of a worker
    "rank",  # a worker's rank in its engine (TP x PP)
    "block_size",
    "layers",
    "layer",
    "version",
    "vllm_version",
    "model",
    "le",
}


def test_hsx_metric_names_follow_prometheus_practice(local_url: str) -> None:
    text = httpx.get(f"{local_url}/metrics", timeout=30).text
    families = [
        f
        for f in text_string_to_metric_families(text)
        # prometheus_client's per-series creation timestamps are not ours to name
        if f.name.startswith("hsx_") and not f.name.endswith("_created")
    ]
    assert len(families) >= 25
    for family in families:
        samples = family.samples
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if family.type == "info":
            assert all(s.name.endswith("_info") for s in samples), family.name
        if any(word in family.name for word in ("memory", "bytes", "size")):
            assert family.name.endswith("_bytes") or family.type == "counter", family.name
        assert not re.search(r"_(ms|milliseconds|kb|mb|gb|percent)\b", family.name)
        for sample in samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (family.name, sample.labels)
