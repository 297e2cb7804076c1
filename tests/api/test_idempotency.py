"""Prompts with a ``custom_id``: one object per prompt however often it is sent.

What "the same custom_id" means (``service.api.idempotency``): the key is the namespace,
the served model and the custom_id; a request gets the stored object only if it asks
for exactly that object (token ids, codec, layers, loss, generated tokens, metadata),
else a 409 naming what differs, and an object under the key that cannot be read is a
409 too. Fast tests run the app around the fake extractor (real local storage); the
engine tests run a real engine behind real uvicorn, reading how often the engine ran
from vLLM's own ``vllm:request_success_total`` on ``/metrics``, as an operator would.
"""

from __future__ import annotations

import asyncio
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
from safetensors.torch import load, save

from service import codecs
from tests.api.conftest import AUTH_A, KEY_A, KEYS, ServerThread, fast_settings
from tests.api.fake import fake_extractor, serving_in_process
from tests.codecs.test_codecs import CORRUPT, rewrite_header
from tests.engine.conftest import random_prompts


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


@pytest.mark.engine
@pytest.mark.slow
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


@pytest.mark.engine
@pytest.mark.slow
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


@pytest.mark.engine
@pytest.mark.slow
def test_the_same_custom_id_with_other_tokens_is_a_409(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    # Issue 26, finding 8: the key hashed the token ids, so other token ids made a
    # second object and the README's 409 could not happen. One custom_id, one key now.
    root = local_engine.root  # type: ignore[attr-defined]
    body = {"prompts": [{"token_ids": [7, 8, 9, 10], "custom_id": "mismatch"}]}
    first = client.post("/extract", json=body, headers=AUTH_A)
    assert first.status_code == 200, first.text
    path = root / first.json()["objects"][0]["key"]
    stored, files, before = path.read_bytes(), by_id(root), engine_runs(client)

    other = {"prompts": [{"token_ids": [7, 8, 9, 11], "custom_id": "mismatch"}]}
    again = client.post("/extract", json=other, headers=AUTH_A)
    assert again.status_code == 409, again.text
    error = again.json()
    assert error["error"]["type"] == "conflict"
    assert error["objects"][0]["error"]["type"] == "conflict"
    message = error["objects"][0]["error"]["message"]
    assert "'mismatch'" in message
    assert "other token ids (4 stored, 4 in this prompt)" in message
    assert path.read_bytes() == stored  # left as it was
    assert by_id(root) == files  # and no second object
    assert engine_runs(client) == before


@pytest.mark.engine
@pytest.mark.slow
def test_the_same_custom_id_with_another_selection_or_expiry_is_a_409(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    # Issue 58, M2: an object stored with tokens "last" was `found`, shape [1, 3, 128],
    # for "all", and for "mean" with the last row instead of a mean; one stored with
    # ttl_s 3 was `found` for a request without a TTL, then a 404 4 s later.
    root = local_engine.root  # type: ignore[attr-defined]
    prompt = random_prompts([12], seed=65)[0]
    last = {"prompts": [{"token_ids": prompt, "custom_id": "sel-last"}], "tokens": "last"}
    # Long enough to outlive the test on a slow machine: a 409 needs the object there.
    short = {"prompts": [{"token_ids": prompt, "custom_id": "ttl-600"}], "ttl_s": 600}
    made = [client.post("/extract", json=body, headers=AUTH_A) for body in (last, short)]
    assert [r.status_code for r in made] == [200, 200], [r.text for r in made]
    objects = [r.json()["objects"][0] for r in made]
    assert objects[0]["shape"][0] == 1  # one row: the last token's
    paths = [root / o["key"] for o in objects]
    stored, before = [p.read_bytes() for p in paths], engine_runs(client)
    for body, says in (
        ({**last, "tokens": "all"}, "other tokens ('last' stored, 'all' asked)"),
        ({**last, "tokens": "mean"}, "other tokens ('last' stored, 'mean' asked)"),
        ({"prompts": short["prompts"]}, "other ttl_s (600 stored, None asked)"),
        ({**short, "ttl_s": 601}, "other ttl_s (600 stored, 601 asked)"),
    ):
        again = client.post("/extract", json=body, headers=AUTH_A)
        assert again.status_code == 409, again.text
        assert again.json()["error"]["type"] == "conflict"
        assert says in again.json()["objects"][0]["error"]["message"]
    found = client.post("/extract", json=last, headers=AUTH_A)  # as it was asked: found
    assert found.status_code == 200, found.text
    assert (found.json()["objects"][0]["status"], found.json()["objects"][0]["sha256"]) == (
        "found",
        objects[0]["sha256"],
    )
    assert [p.read_bytes() for p in paths] == stored  # left as they were
    assert engine_runs(client) == before


@pytest.mark.engine
@pytest.mark.slow
def test_an_objects_metadata_names_the_served_model_never_its_path(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    # Issue 58, L3: every object's `model` was the server's path to the model, which
    # every reader of an object learnt. It is the name /v1/models answers now.
    body = {"prompts": [{"token_ids": [7, 8, 9], "custom_id": "served-name"}]}
    made = client.post("/extract", json=body, headers=AUTH_A)
    assert made.status_code == 200, made.text
    fetched = client.get(f"/objects/{made.json()['objects'][0]['key']}", headers=AUTH_A)
    assert fetched.status_code == 200
    metadata = codecs.read_metadata(fetched.content)
    (served,) = [m["id"] for m in client.get("/v1/models", headers=AUTH_A).json()["data"]]
    assert metadata["model"] == served
    path = str(local_engine.settings.engine.model)
    assert path != served
    assert not [k for k, v in metadata.items() if path in v or str(local_engine.root) in v]


@pytest.mark.engine
@pytest.mark.slow
def test_v1_routes_honour_custom_id_metadata_and_output_tokens(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    # Issue 26, finding 8: /v1/completions ignored custom_id, metadata and
    # include_output_tokens in the extra body. They mean what they mean on /extract.
    from tests.api.openai_helpers import served_name

    root = local_engine.root  # type: ignore[attr-defined]
    prompts = random_prompts([9, 14], seed=64)
    body: dict[str, Any] = {
        "model": served_name(local_engine),
        "prompt": prompts,
        "max_tokens": 3,
        "custom_id": ["v1-a", "v1-b"],
        "metadata": {"split": "train"},
        "include_output_tokens": True,
    }
    before = engine_runs(client)
    first = client.post("/v1/completions", json=body, headers=AUTH_A)
    assert first.status_code == 200, first.text
    params = [c["kv_transfer_params"] for c in first.json()["choices"]]
    assert all("/by-id/" in p["key"] for p in params)
    for p, prompt in zip(params, prompts, strict=True):
        stored = load((root / p["key"]).read_bytes())
        assert stored["token_ids"].tolist()[: len(prompt)] == prompt
        assert p["num_tokens"] == len(prompt) + 2  # the generated tokens that have states
    metas = [codecs.read_metadata((root / p["key"]).read_bytes()) for p in params]
    assert all(m["split"] == "train" for m in metas)
    assert_runs(client, before + 2)

    again = client.post("/v1/completions", json=body, headers=AUTH_A)
    assert again.status_code == 200, again.text
    found = [c["kv_transfer_params"] for c in again.json()["choices"]]
    assert [(p["key"], p["sha256"]) for p in found] == [(p["key"], p["sha256"]) for p in params]
    assert engine_runs(client) == before + 2  # found: the engine did not run

    other = client.post(
        "/v1/completions", json={**body, "metadata": {"split": "test"}}, headers=AUTH_A
    )
    assert other.status_code == 409, other.text
    error = other.json()["error"]
    assert (error["type"], error["code"]) == ("conflict", 409)
    messages = [o["error"]["message"] for o in other.json()["objects"]]
    assert all("other metadata (keys 'split' differ)" in m for m in messages)

    one = client.post(
        "/v1/completions", json={**body, "custom_id": "v1-a"}, headers=AUTH_A
    )  # a string names one prompt only
    assert one.status_code == 400, one.text
    assert one.json()["error"]["param"] == "custom_id"

    chat = {
        "model": served_name(local_engine),
        "messages": [{"role": "user", "content": "once"}],
        "custom_id": "v1-chat",
    }
    made = client.post("/v1/chat/completions", json=chat, headers=AUTH_A)
    assert made.status_code == 200, made.text
    kept = client.post("/v1/chat/completions", json=chat, headers=AUTH_A)
    assert kept.status_code == 200, kept.text
    assert (
        kept.json()["kv_transfer_params"]["sha256"] == made.json()["kv_transfer_params"]["sha256"]
    )
    assert engine_runs(client) == before + 3


CLIENT = """
import json, sys, httpx
url, key, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
httpx.post(url + "/extract", json=body, headers={"Authorization": "Bearer " + key}, timeout=120)
"""


@pytest.mark.engine
@pytest.mark.slow
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


# ==============================
# Fast: the app around the fake extractor (real tokenizer, real local storage)
# ==============================

ROW = {"token_ids": [5, 6, 7, 8], "custom_id": "row-1"}
FIRST: dict[str, Any] = {"prompts": [ROW], "metadata": {"split": "train"}}


async def stored_first(app_client: httpx.AsyncClient, fake: Any) -> tuple[dict[str, Any], Path]:
    """The object ``FIRST`` stores, and its file."""
    made = await app_client.post("/extract", json=FIRST, headers=AUTH_A)
    assert made.status_code == 200, made.text
    obj = made.json()["objects"][0]
    assert obj["status"] == "created"
    return obj, fake.storage.root / obj["key"]


async def assert_conflict(
    app_client: httpx.AsyncClient, fake: Any, path: Path, body: dict[str, Any], says: str
) -> None:
    """``body`` is a 409 whose one prompt's error says ``says``; nothing changed."""
    stored, submitted, files = path.read_bytes(), fake.submitted, set(path.parent.iterdir())
    response = await app_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 409, response.text
    answer = response.json()
    assert answer["error"]["type"] == "conflict"
    assert answer["error"]["index"] == 0
    (outcome,) = answer["objects"]
    assert outcome["error"]["type"] == "conflict"
    assert "custom_id 'row-1'" in outcome["error"]["message"]
    assert says in outcome["error"]["message"], outcome["error"]["message"]
    assert path.read_bytes() == stored  # left as it was
    assert fake.submitted == submitted  # the engine did not run
    assert set(path.parent.iterdir()) == files  # no second object, no other expiry
    assert {p.name for p in files if not p.name.startswith(".")} == {path.name}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"prompts": [{**ROW, "token_ids": [5, 6, 7, 9]}]}, "other token ids (4 stored, 4 in"),
        ({"prompts": [{**ROW, "token_ids": [5, 6, 7]}]}, "other token ids (4 stored, 3 in"),
        ({"prompts": [{**ROW, "token_ids": [5, 6, 7, 8, 9]}]}, "other token ids (4 stored, 5"),
        ({"prompts": [{"text": "hello", "custom_id": "row-1"}]}, "other token ids"),
        ({"codec": "fp8"}, "other codec ('raw' stored, 'fp8' asked)"),
        ({"layers": [1, 2]}, "other layers ([1, 2, 4] stored, [1, 2] asked)"),
        ({"loss": "all"}, "other loss ('none' stored, 'all' asked)"),
        ({"include_output_tokens": True}, "other include_output_tokens (False stored, True"),
        ({"metadata": {"split": "test"}}, "other metadata (keys 'split' differ)"),
        ({"metadata": {}}, "other metadata (keys 'split' differ)"),
        ({"metadata": {"split": "train", "n": "1"}}, "other metadata (keys 'n' differ)"),
        ({"tokens": "last"}, "other tokens ('all' stored, 'last' asked)"),
        ({"tokens": {"start": 0, "end": 2}}, "other tokens ('all' stored, {'start': 0, 'end': 2}"),
        ({"ttl_s": 60}, "other ttl_s (None stored, 60 asked)"),
    ],
)
async def test_a_custom_id_sent_with_another_request_is_a_409_naming_it(
    app_client: httpx.AsyncClient, fake: Any, change: dict[str, Any], says: str
) -> None:
    # Issue 26, finding 8: other token ids or options made a second object under the
    # same custom_id, and other metadata answered `found` with the old metadata.
    _, path = await stored_first(app_client, fake)
    await assert_conflict(app_client, fake, path, {**FIRST, **change}, says)


async def test_the_same_request_is_found_and_max_tokens_matters_with_output_tokens(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    obj, path = await stored_first(app_client, fake)
    submitted = fake.submitted
    for same in (FIRST, {**FIRST, "codec": "raw", "layers": [1, 2, 4]}, {**FIRST, "max_tokens": 5}):
        # The default codec and layers named, or max_tokens without output tokens (it
        # changes nothing stored): the same object.
        again = await app_client.post("/extract", json=same, headers=AUTH_A)
        assert again.status_code == 200, again.text
        found = again.json()["objects"][0]
        assert found["status"] == "found"
        assert (found["key"], found["sha256"], found["bytes"]) == (
            obj["key"],
            obj["sha256"],
            obj["bytes"],
        )
    assert fake.submitted == submitted
    assert codecs.read_metadata(path.read_bytes())["split"] == "train"

    generating = {**FIRST, "prompts": [{**ROW, "custom_id": "gen"}]}
    generating |= {"include_output_tokens": True, "max_tokens": 3}
    made = await app_client.post("/extract", json=generating, headers=AUTH_A)
    assert made.status_code == 200, made.text
    longer = await app_client.post("/extract", json={**generating, "max_tokens": 4}, headers=AUTH_A)
    assert longer.status_code == 409, longer.text
    assert "other max_tokens (3 stored, 4 asked)" in longer.json()["objects"][0]["error"]["message"]


async def test_a_selection_and_an_expiry_are_found_only_as_they_were_asked(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    # Issue 58, M2: tokens and ttl_s were not recorded, so `last` was found for `all`
    # and an object that expires was found for a request without a TTL.
    asked = {**FIRST, "tokens": {"start": 1, "end": 3}, "ttl_s": 3600}
    made = await app_client.post("/extract", json=asked, headers=AUTH_A)
    assert made.status_code == 200, made.text
    obj = made.json()["objects"][0]
    path = fake.storage.root / obj["key"]
    again = await app_client.post("/extract", json=asked, headers=AUTH_A)
    assert again.status_code == 200, again.text
    assert (again.json()["objects"][0]["status"], again.json()["objects"][0]["sha256"]) == (
        "found",
        obj["sha256"],
    )
    await assert_conflict(
        app_client, fake, path, {**asked, "ttl_s": 60}, "other ttl_s (3600 stored, 60 asked)"
    )
    await assert_conflict(
        app_client,
        fake,
        path,
        {**asked, "tokens": {"start": 1, "end": -1}},
        "other tokens ({'end': 3, 'start': 1} stored, {'start': 1, 'end': -1} asked)",
    )


async def test_different_requests_in_flight_for_one_custom_id_never_share_a_run(
    app_client: httpx.AsyncClient, fake: Any
) -> None:
    # Concurrent requests shared one run by key: a request with other token ids joined
    # the first one's run and was answered `found` with the first one's object.
    fake.held.add(4)
    first = asyncio.ensure_future(app_client.post("/extract", json=FIRST, headers=AUTH_A))
    other = {**FIRST, "prompts": [{**ROW, "token_ids": [1, 2, 3, 4]}]}
    second = asyncio.ensure_future(app_client.post("/extract", json=other, headers=AUTH_A))
    while fake.waiting < 2:  # both past their lookup, in the "engine"
        await asyncio.sleep(0.01)
    fake.gate.set()
    answers = {r.status_code: r for r in await asyncio.gather(first, second)}
    assert sorted(answers) == [200, 409], [r.text for r in answers.values()]
    winner = answers[200].json()["objects"][0]
    assert winner["status"] == "created"
    stored = load((fake.storage.root / winner["key"]).read_bytes())["token_ids"].tolist()
    loser = answers[409].json()["objects"][0]["error"]["message"]
    assert "other token ids (4 stored, 4 in this prompt)" in loser
    assert stored in ([5, 6, 7, 8], [1, 2, 3, 4])


#: Rounds of the two-replica race (the red team saw 8 of 20 go wrong).
RACE_ROUNDS = 20


async def test_two_replicas_racing_with_and_without_a_ttl_never_create_what_then_expires(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    # Issue 58, M2: two replicas on one root, one request with ttl_s and one without,
    # both past their lookup. The no-TTL one was answered `created` and its object
    # expired 3 s later (8 of 20 rounds): the loser rewrote the winner's expiry, and the
    # other request was `found` whatever its TTL. One wins now; the other is a 409.
    replicas = [fake_extractor(tmp_path / "objects", tokenizer_dir) for _ in range(2)]
    async with (
        serving_in_process(fast_settings(tmp_path), replicas[0], KEYS) as (_, first),
        serving_in_process(fast_settings(tmp_path), replicas[1], KEYS) as (_, second),
    ):
        created = [await _race(first, second, replicas, i) for i in range(RACE_ROUNDS)]
        expiring = [key for key, ttl in created if ttl]
        deadline = time.monotonic() + 10
        while not all([await _gone(first, key) for key in expiring]):
            assert time.monotonic() < deadline, "an object created with ttl_s did not expire"
            await asyncio.sleep(0.05)
        for key, ttl in created:
            if not ttl:  # answered `created` without a TTL: still there, past every TTL
                assert (await first.get(f"/objects/{key}", headers=AUTH_A)).status_code == 200


async def _race(
    first: httpx.AsyncClient, second: httpx.AsyncClient, replicas: list[Any], round_: int
) -> tuple[str, bool]:
    """One round: a prompt with ttl_s on one replica and without on the other (which
    one alternates, and so does which is let go first), both held past their lookup
    and let go together. The created object's key and whether its request had a TTL."""
    prompt = {"token_ids": [5, 6, 7, 8, 9, 10], "custom_id": f"race-{round_}"}
    for fake in replicas:
        fake.gate.clear()
        fake.held.add(len(prompt["token_ids"]))
    clients = (first, second) if round_ % 2 else (second, first)
    answers = asyncio.gather(
        clients[0].post("/extract", json={"prompts": [prompt], "ttl_s": 2}, headers=AUTH_A),
        clients[1].post("/extract", json={"prompts": [prompt]}, headers=AUTH_A),
    )
    while sum(fake.waiting for fake in replicas) < 2:
        await asyncio.sleep(0.005)
    for fake in replicas if round_ % 4 < 2 else replicas[::-1]:
        fake.gate.set()
    with_ttl, without = await answers
    assert sorted([with_ttl.status_code, without.status_code]) == [200, 409]
    winner, loser = (with_ttl, without) if with_ttl.status_code == 200 else (without, with_ttl)
    assert "other ttl_s (" in loser.json()["objects"][0]["error"]["message"]
    made = winner.json()["objects"][0]
    assert made["status"] == "created"
    return made["key"], winner is with_ttl


async def _gone(client: httpx.AsyncClient, key: str) -> bool:
    return (await client.get(f"/objects/{key}", headers=AUTH_A)).status_code == 404


async def test_metadata_the_server_records_cannot_be_sent_with_a_custom_id(
    app_client: httpx.AsyncClient,
) -> None:
    body = {**FIRST, "metadata": {"hsx.request": "{}"}}
    response = await app_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422, response.text
    message = response.json()["objects"][0]["error"]["message"]
    assert "metadata: 'hsx.request' is set by the server" in message


def _with_request_record(data: bytes, record: str | None) -> bytes:
    def change(header: dict[str, Any]) -> dict[str, Any]:
        if record is None:
            del header["__metadata__"]["hsx.request"]
        else:
            header["__metadata__"]["hsx.request"] = record
        return header

    return rewrite_header(data, change)


def _older_record(data: bytes) -> str:
    """The object's ``hsx.request`` as hsx wrote it before issue 58: no tokens, no ttl_s."""
    record = json.loads(codecs.read_metadata(data)["hsx.request"])
    return json.dumps({k: v for k, v in record.items() if k not in ("tokens", "ttl_s")})


#: Stored objects whose token ids match the prompt's but that cannot be read as an
#: object under a custom_id (issue 26, finding 7: these answered 500).
UNREADABLE: dict[str, Any] = {
    "layer_ids not JSON": lambda good: rewrite_header(
        good, lambda h: {**h, "__metadata__": {**h["__metadata__"], "layer_ids": "[1,"}}
    ),
    "a number in __metadata__": lambda good: rewrite_header(
        good, lambda h: {**h, "__metadata__": {**h["__metadata__"], "n": 1}}
    ),
    "no hidden_states": lambda good: save(
        {"token_ids": load(good)["token_ids"]}, metadata=codecs.read_metadata(good)
    ),
    "no hsx.request": lambda good: _with_request_record(good, None),
    "hsx.request not JSON": lambda good: _with_request_record(good, "{codec"),
    "hsx.request a list": lambda good: _with_request_record(good, "[]"),
    "hsx.request without tokens and ttl_s": lambda good: _with_request_record(
        good, _older_record(good)
    ),
    **{name: lambda good, make=make: make() for name, (make, _) in CORRUPT.items()},
}


@pytest.mark.parametrize("case", list(UNREADABLE))
async def test_an_unreadable_object_under_a_custom_id_is_a_409(
    app_client: httpx.AsyncClient, fake: Any, case: str
) -> None:
    _, path = await stored_first(app_client, fake)
    broken = UNREADABLE[case](path.read_bytes())
    path.unlink()
    path.write_bytes(broken)
    await assert_conflict(app_client, fake, path, FIRST, "is not a readable hidden-state object (")
