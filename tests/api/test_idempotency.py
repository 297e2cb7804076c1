"""Prompts with a ``custom_id``: one object per prompt however often it is sent.

Real engine, real uvicorn, local disk. How often the engine ran is read from vLLM's own
``vllm:request_success_total`` on ``/metrics``, as an operator would.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load, save

from tests.api.conftest import AUTH_A, KEY_A, ServerThread
from tests.engine.conftest import random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def engine_runs(client: httpx.Client) -> float:
    """Requests the engine finished, from vLLM's counter on /metrics."""
    text = client.get("/metrics").text
    found = re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert found, "vllm:request_success_total is missing from /metrics"
    return sum(float(v) for v in found)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def assert_runs(client: httpx.Client, expected: float) -> None:
    """vLLM counts a request just after its output is handed over: wait, then compare."""
    wait_for(lambda: engine_runs(client) >= expected)
    assert engine_runs(client) == expected


def by_id(root: Path) -> set[Path]:
    """Published objects under idempotent keys (not the writers' temp files)."""
    base = root / "hsx" / "team-a" / "by-id"
    return set(base.rglob("[0-9a-f]*.safetensors")) if base.exists() else set()


def test_same_request_twice(client: httpx.Client, local_engine: ServerThread) -> None:
    root = local_engine.root  # type: ignore[attr-defined]
    prompts = random_prompts([20, 45, 12], seed=61)
    body = {
        "prompts": [
            {"token_ids": prompts[0], "custom_id": "twice-0"},
            {"messages": [{"role": "user", "content": "twice"}], "custom_id": "twice-1"},
            {"token_ids": prompts[2]},  # no custom_id: a new object each time
        ],
        "loss": "all",
    }
    before, files = engine_runs(client), by_id(root)
    first = client.post("/extract", json=body, headers=AUTH_A)
    assert first.status_code == 200, first.text
    created = first.json()["objects"]
    assert [o["status"] for o in created] == ["created"] * 3
    assert all("/by-id/" in o["key"] for o in created[:2])
    assert "/by-id/" not in created[2]["key"]
    assert_runs(client, before + 3)

    second = client.post("/extract", json=body, headers=AUTH_A)
    assert second.status_code == 200, second.text
    again = second.json()["objects"]
    assert [o["status"] for o in again] == ["found", "found", "created"]
    for old, new in zip(created[:2], again[:2], strict=True):
        keep = ("key", "uri", "bytes", "sha256", "num_tokens", "shape", "num_loss_tokens")
        assert {k: new[k] for k in keep} == {k: old[k] for k in keep}
    assert again[2]["key"] != created[2]["key"]
    for obj in again[:2]:  # the found objects read back like any other
        fetched = client.get(f"/objects/{obj['key']}", headers=AUTH_A)
        assert fetched.status_code == 200
        assert hashlib.sha256(fetched.content).hexdigest() == obj["sha256"]
        assert int(load(fetched.content)["loss_mask"].sum()) == obj["num_loss_tokens"]
    assert_runs(client, before + 4)  # only the prompt without a custom_id ran again
    assert len(by_id(root) - files) == 2


def test_sixteen_concurrent_duplicates_run_once(
    client: httpx.Client, local_url: str, local_engine: ServerThread
) -> None:
    root = local_engine.root  # type: ignore[attr-defined]
    body = {"prompts": [{"token_ids": random_prompts([150], seed=62)[0], "custom_id": "c16"}]}
    before, files = engine_runs(client), by_id(root)

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=local_url, timeout=120) as own:
            return own.post("/extract", json=body, headers=AUTH_A)

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(send, range(16)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    objects = [r.json()["objects"][0] for r in responses]
    assert sorted(o["status"] for o in objects) == ["created"] + ["found"] * 15
    assert len({(o["key"], o["sha256"]) for o in objects}) == 1
    assert_runs(client, before + 1)
    assert [p.relative_to(root).as_posix() for p in by_id(root) - files] == [objects[0]["key"]]


def test_stored_object_with_other_tokens_is_refused(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    root = local_engine.root  # type: ignore[attr-defined]
    body = {"prompts": [{"token_ids": [7, 8, 9, 10], "custom_id": "mismatch"}]}
    first = client.post("/extract", json=body, headers=AUTH_A)
    assert first.status_code == 200, first.text
    path = root / first.json()["objects"][0]["key"]
    # Another writer's object under the same key (the key hashes the token ids, so only
    # a foreign writer or a damaged store can produce this).
    tensors = load(path.read_bytes())
    tensors["token_ids"] = torch.tensor([7, 8, 9, 11])
    foreign = save(tensors)
    path.unlink()
    path.write_bytes(foreign)
    before = engine_runs(client)

    again = client.post("/extract", json=body, headers=AUTH_A)
    assert again.status_code == 409, again.text
    error = again.json()
    assert error["error"]["type"] == "conflict"
    assert "'mismatch'" in error["objects"][0]["error"]["message"]
    assert "other token ids" in error["objects"][0]["error"]["message"]
    assert path.read_bytes() == foreign  # left as it was
    assert engine_runs(client) == before


CLIENT = """
import json, sys, httpx
url, key, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
httpx.post(url + "/extract", json=body, headers={"Authorization": "Bearer " + key}, timeout=120)
"""


def test_killed_clients_retry_gets_the_object(
    client: httpx.Client, local_url: str, local_engine: ServerThread
) -> None:
    root = local_engine.root  # type: ignore[attr-defined]
    body: dict[str, Any] = {
        "prompts": [{"token_ids": random_prompts([300], seed=63)[0], "custom_id": "killed"}],
        "max_tokens": 16,
    }
    before, files = engine_runs(client), by_id(root)
    killed = subprocess.Popen([sys.executable, "-c", CLIENT, local_url, KEY_A, json.dumps(body)])
    try:
        wait_for(lambda: bool(by_id(root) - files), timeout=120)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    (path,) = by_id(root) - files
    stored = path.read_bytes()

    retry = client.post("/extract", json=body, headers=AUTH_A)
    assert retry.status_code == 200, retry.text
    obj = retry.json()["objects"][0]
    assert (obj["status"], obj["key"]) == ("found", path.relative_to(root).as_posix())
    assert path.read_bytes() == stored
    assert_runs(client, before + 1)
    assert not local_engine.unfinished()
