"""An OpenAI Batch API file through ``hsx dataset run`` on the real engine: each line's
object equals the one hsx's ``/v1`` route stores for the same body (issue 32).

The stand-in tests (``tests/dataset/test_batch_api.py``) show that a Batch line sends
``/extract`` what the equivalent native row sends. Here both paths meet the engine: the
dataset's ``/extract`` renders and tokenises the line's prompt itself, the ``/v1``
routes render it with vLLM's own front end, and the stored objects must be the same.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from service import codecs
from service.api.idempotency import REQUEST_KEY
from service.cli import main
from service.dataset import RunOptions, run_dataset
from tests.api.conftest import AUTH_A, AUTH_B, KEY_A, ServerThread
from tests.api.openai_helpers import served_name
from tests.engine.conftest import random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SYSTEM_USER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The quick brown fox?"},
]
#: Text parts, which the dataset joins with newlines as vLLM's renderer does.
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Hidden states"},
            {"type": "text", "text": "of which layers?"},
        ],
    },
]
DONE = [*SYSTEM_USER, {"role": "assistant", "content": "Jumps over the lazy dog."}]
TEXT = "The quick brown fox jumps over the lazy dog."
IDS = random_prompts([23, 9], seed=71)


def batch_line(
    custom_id: str, url: str, body: dict[str, Any], method: str | None = "POST"
) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def good_lines(tag: str, model: str) -> list[dict[str, Any]]:
    """Lines the run accepts: chat (system and user; text parts; a finished turn) and
    completions (text; one text in a list, no max_tokens; token ids, flat and nested),
    with fields that change only the answer (seed, top_p, return_token_ids...)."""
    return [
        batch_line(f"{tag}-chat", CHAT_URL, {
            "model": model, "messages": SYSTEM_USER, "max_tokens": 1, "seed": 3, "top_p": 0.5}),
        batch_line(f"{tag}-parts", CHAT_URL, {"model": model, "messages": PARTS}),
        batch_line(f"{tag}-done", CHAT_URL, {
            "model": model, "messages": DONE, "add_generation_prompt": False,
            "temperature": 0, "max_completion_tokens": 1}),
        batch_line(f"{tag}-text", COMPLETIONS_URL, {
            "model": model, "prompt": TEXT, "max_tokens": 1, "user": "someone"}),
        # No max_tokens: the route generates its default 16, the run 1; without
        # --include-output-tokens the object holds the prompt's states only.
        batch_line(f"{tag}-text-list", COMPLETIONS_URL, {"prompt": ["One text in a list."]}),
        batch_line(f"{tag}-ids", COMPLETIONS_URL, {
            "model": model, "prompt": IDS[0], "max_tokens": 1, "return_token_ids": True}),
        batch_line(f"{tag}-ids-nested", COMPLETIONS_URL, {"prompt": [IDS[1]], "max_tokens": 1}),
    ]  # fmt: skip


def refused_lines(tag: str) -> list[tuple[dict[str, Any], list[str]]]:
    """Lines the run refuses, and what their reason must name."""
    chat = {"messages": SYSTEM_USER, "max_tokens": 1}
    return [
        (
            batch_line(f"{tag}-embeddings", "/v1/embeddings", {"input": TEXT}),
            ["url '/v1/embeddings'", CHAT_URL, COMPLETIONS_URL],
        ),
        (
            batch_line(f"{tag}-responses", "/v1/responses", {"input": TEXT}),
            ["url '/v1/responses'"],
        ),
        (
            batch_line(f"{tag}-slash", COMPLETIONS_URL + "/", {"prompt": TEXT}),
            ["url '/v1/completions/'"],
        ),
        (batch_line(f"{tag}-get", CHAT_URL, chat, method="GET"), ["method 'GET'", "only POST"]),
        (batch_line(f"{tag}-no-method", CHAT_URL, chat, method=None), ["method None"]),
    ]


def fetch(client: httpx.Client, key: str, headers: dict[str, str]) -> bytes:
    response = client.get(f"/objects/{key}", headers=headers)
    assert response.status_code == 200, response.text
    return response.content


def tensor_bytes(data: bytes) -> bytes:
    """A safetensors object's bytes after its header (offsets there are relative to it)."""
    return data[8 + int.from_bytes(data[:8], "little") :]


def forget_cached_states(engine: ServerThread) -> None:
    """Empty the engine's prefix cache (the tests' engine has it on, as ``hsx serve``
    has for a dense model), so the next request computes every state again instead of
    reading the blocks an earlier request with the same prefix left there."""
    assert engine.call(engine.extractor.engine.reset_prefix_cache())


def ask_v1(
    client: httpx.Client, line: dict[str, Any], headers: dict[str, str], **extra: Any
) -> dict[str, Any]:
    """The line's body sent to its own ``/v1`` route; the object's transfer params."""
    response = client.post(line["url"], json={**line["body"], **extra}, headers=headers)
    assert response.status_code == 200, (line["custom_id"], response.text)
    answer = response.json()
    params: dict[str, Any] = answer["kv_transfer_params"]
    assert answer["choices"][0]["kv_transfer_params"] == params
    return params


def test_a_batch_file_run_stores_the_objects_the_v1_routes_store(
    local_engine: ServerThread, local_url: str, client: httpx.Client, tmp_path: Path
) -> None:
    model = served_name(local_engine)
    tag = f"batch-{uuid.uuid4().hex[:8]}"  # custom_ids of their own in the shared storage
    good = good_lines(tag, model)
    refused = refused_lines(tag)
    rows = [*good[:3], refused[0][0], *good[3:5], *(r for r, _ in refused[1:]), *good[5:]]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))

    output = tmp_path / "run"
    options = RunOptions(
        input=str(source), endpoints=[local_url], output=str(output), api_key=KEY_A,
        progress=False,
    )  # fmt: skip
    summary = run_dataset(options)
    assert (summary.ok, summary.failed, summary.skipped, summary.pending) == (
        len(good),
        len(refused),
        0,
        0,
    )
    assert summary.complete

    records = [json.loads(x) for x in (output / "manifest.jsonl").read_text().splitlines()]
    # One record per line, in no particular order; ok lines each name their own object.
    by_id = {r["custom_id"]: r for r in records}
    assert len(records) == len(by_id) == len(rows)
    assert set(by_id) == {r["custom_id"] for r in rows}
    keys = [by_id[line["custom_id"]]["key"] for line in good]
    assert all(keys)
    assert len(set(keys)) == len(good)

    # Refused lines: decided for good, nothing stored, the reason names the row, its
    # custom_id and what is wrong (service.dataset.batch_api.batch_prompt).
    for line, names in refused:
        record = by_id[line["custom_id"]]
        row = rows.index(line)
        assert record["status"] == "failed"
        assert record["retryable"] is False
        assert record.get("key") is None  # the manifest leaves absent fields out
        reason = record["reason"]
        assert reason.startswith(f"malformed: row {row} (custom_id {line['custom_id']!r}): "), (
            reason
        )
        for name in names:
            assert name in reason, (name, reason)

    tokenizer = local_engine.extractor.tokenizer
    found: dict[str, dict[str, Any]] = {}
    for line in good:
        custom_id, record = line["custom_id"], by_id[line["custom_id"]]
        assert record["status"] == "ok", record
        ran = fetch(client, record["key"], AUTH_A)
        assert len(ran) == record["bytes"]
        assert hashlib.sha256(ran).hexdigest() == record["sha256"]
        ran_tensors, ran_meta = codecs.decode(ran)

        # 1. The body exactly as the line gives it, sent to its route. No custom_id:
        # a fresh dated key, and its metadata lacks the run's ``hsx.request`` (the
        # options recorded on objects made under a custom_id), so the bytes differ in
        # the header only: the decoded tensors must be equal, bit for bit.
        forget_cached_states(local_engine)
        params = ask_v1(client, line, AUTH_A)
        assert params["key"] != record["key"]
        assert params["num_tokens"] == record["num_tokens"], custom_id
        assert params["num_loss_tokens"] == record.get("num_loss_tokens"), custom_id
        sent = fetch(client, params["key"], AUTH_A)
        assert tensor_bytes(sent) == tensor_bytes(ran), custom_id
        sent_tensors, sent_meta = codecs.decode(sent)
        assert set(sent_tensors) == set(ran_tensors) == {"hidden_states", "token_ids"}
        assert torch.equal(sent_tensors["token_ids"], ran_tensors["token_ids"]), custom_id
        assert sent_tensors["hidden_states"].dtype == ran_tensors["hidden_states"].dtype
        assert torch.equal(sent_tensors["hidden_states"], ran_tensors["hidden_states"]), custom_id
        assert REQUEST_KEY not in sent_meta
        assert {k: v for k, v in ran_meta.items() if k != REQUEST_KEY} == sent_meta

        # 2. The body with the line's custom_id, as team-b (another namespace, so a new
        # key and a fresh extraction rather than the run's object found again). The
        # object records the same options under ``hsx.request`` and no key or
        # namespace, so here the bytes themselves must be equal.
        forget_cached_states(local_engine)
        params_b = ask_v1(client, line, AUTH_B, custom_id=custom_id)
        assert params_b["key"].startswith("hsx/team-b/by-id/")
        assert (params_b["sha256"], params_b["bytes"]) == (record["sha256"], record["bytes"])
        assert fetch(client, params_b["key"], AUTH_B) == ran

        # The token ids are the prompt's: given, or the text tokenised with BOS.
        prompt = line["body"].get("prompt")
        stored_ids = ran_tensors["token_ids"].tolist()
        if prompt == TEXT:
            assert stored_ids == tokenizer.encode(TEXT)
        elif isinstance(prompt, list) and isinstance(prompt[0], int):
            assert stored_ids == prompt
        elif isinstance(prompt, list) and isinstance(prompt[0], list):
            assert stored_ids == prompt[0]

        # 3. The body with the line's custom_id, as team-a (the run's key): the route
        # finds the run's object, and ``hsx dataset export --format openai-batch``
        # answers the line with the transfer params the route answers.
        found[custom_id] = ask_v1(client, line, AUTH_A, custom_id=custom_id)
        assert found[custom_id]["key"] == record["key"]

    dest = tmp_path / "results.jsonl"
    storage_url = local_engine.settings.storage.url
    code = main(["dataset", "export", str(output), str(dest), "--format", "openai-batch",
                 "--endpoint", local_url, "--storage-url", storage_url])  # fmt: skip
    assert code == 0
    exported = [json.loads(x) for x in dest.read_text().splitlines()]
    assert [x["custom_id"] for x in exported] == [r["custom_id"] for r in rows]  # input order
    for got in exported:
        if got["custom_id"] not in found:
            assert got["response"] is None
            assert got["error"]["code"] == "malformed"
            assert got["error"]["message"] == by_id[got["custom_id"]]["reason"]
            continue
        assert got["error"] is None
        assert got["response"]["body"]["model"] == model
        params = got["response"]["body"]["kv_transfer_params"]
        route = {k: v for k, v in found[got["custom_id"]].items() if k != "shape"}
        assert params == route, got["custom_id"]
