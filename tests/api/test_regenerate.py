"""``regenerate`` on the real engine (the tiny Llama, float32, prefix caching on as
``hsx serve`` has it for a dense model), on tests/api's shared engine.

A regenerated object must hold, in one pass over the target:
- the ids the engine generated for each turn (checked against the same engine asked
  again, greedy, from the stored ids before the turn), the template's tokens around them;
- the states of every stored token, equal to a plain prefill of the same ids (prefix
  cache emptied first) within 1e-5;
- a loss mask over exactly each turn's generated and end-of-turn tokens;
and the target's forward tokens for the row stay within one block per request of
the row's own tokens (vLLM's ``num_cached_tokens``).

The tiny model's weights are random: its answers are noise of realistic shape, and
the forward-token ratio here depends on their length, not on what a real model says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from service.engine.wire import Sampling
from service.masks import render_text
from tests.api.conftest import AUTH_A, KEY_A, KEY_B, ServerThread, objects_under
from tests.api.test_batch_api_engine import forget_cached_states
from tests.engine.conftest import engine_requests

pytestmark = [pytest.mark.engine, pytest.mark.slow]

#: Long enough that every request after the first finds full KV blocks (CPU: 128 tokens).
SYSTEM = " ".join(f"Rule {i}: answer the question and keep the answer short." for i in range(5))
SINGLE = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]
#: Three assistant turns and a tool turn; the original answers are replaced.
MULTI = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the weather in Paris today?"},
    {"role": "assistant", "content": "I will look it up."},
    {"role": "tool", "content": '{"city": "Paris", "sky": "clear", "celsius": 21}'},
    {"role": "assistant", "content": "It is clear and 21 degrees."},
    {"role": "user", "content": "And should I take an umbrella for the evening walk?"},
    {"role": "assistant", "content": "No."},
]


RATIOS: list[float] = []


def regenerate(client: httpx.Client, prompts: list[dict[str, Any]], **body: Any) -> Any:
    response = client.post(
        "/extract",
        json={"prompts": prompts, "regenerate": {"max_tokens": 24}, "loss": "assistant", **body},
        headers=AUTH_A,
    )
    return response


def stored(client: httpx.Client, key: str) -> dict[str, torch.Tensor]:
    response = client.get(f"/objects/{key}", headers=AUTH_A)
    assert response.status_code == 200, response.text
    return load(response.content)


def greedy(engine: ServerThread, prompt: list[int], max_tokens: int) -> list[int]:
    out = engine.call(engine.extractor.generate(prompt, Sampling(max_tokens=max_tokens)))
    return list(out.token_ids)


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "three-turns-and-tool"])
def test_regenerated_object_is_what_the_engine_generated(
    local_engine: ServerThread, client: httpx.Client, messages: list[dict[str, str]]
) -> None:
    response = regenerate(client, [{"messages": messages}])
    assert response.status_code == 200, response.text
    (obj,) = response.json()["objects"]
    info = obj["regenerated"]
    ids = info["token_ids"]
    tensors = stored(client, obj["key"])
    assert tensors["token_ids"].tolist() == ids
    assert obj["num_tokens"] == len(ids)

    turns = info["turns"]
    assert len(turns) == (1 if messages is SINGLE else 3)
    # The first turn's prompt is the template's render with the generation prompt.
    tokenizer = local_engine.extractor.tokenizer
    opened = render_text(tokenizer, messages[: turns[0]["message"]], add_generation_prompt=True)
    assert ids[: turns[0]["start"]] == tokenizer.encode(opened, add_special_tokens=False)
    mask = [0] * len(ids)
    for turn in turns:
        start, generated = turn["start"], turn["generated"]
        # The same engine, asked again from the stored ids before the turn, greedy.
        assert ids[start : start + generated] == greedy(local_engine, ids[:start], generated)
        assert turn["end"] > start + generated or turn["finish_reason"] == "stop"
        for i in range(start, turn["end"]):
            mask[i] = 1
        assert info["messages"][turn["message"]]["role"] == "assistant"
    # The tiny template ends a turn with "\n" only: the end-of-turn token after each answer.
    newline = tokenizer.encode("\n", add_special_tokens=False)
    for turn in turns:
        assert ids[turn["end"] - len(newline) : turn["end"]] == newline
    # Kept turns: every non-assistant message is the input's, in order.
    kept = [m for m in info["messages"] if m["role"] != "assistant"]
    assert kept == [m for m in messages if m["role"] != "assistant"]
    assert tensors["loss_mask"].tolist() == mask
    assert obj["num_loss_tokens"] == sum(mask)

    # One pass: the final request found every full block in the prefix cache (the
    # generated tokens' states their decode steps wrote), and no request recomputed
    # more than its last partial block.
    block = local_engine.extractor.prefix_block_size
    assert block
    assert len(ids) > block
    assert info["final_cached_tokens"] == (len(ids) - 1) // block * block
    assert info["recomputed_tokens"] == 0
    assert info["forward_tokens"] <= len(ids) + (len(turns) + 1) * block, info
    RATIOS.append(info["forward_tokens"] / len(ids))

    # The states equal a plain prefill of the same ids, the prefix cache emptied first.
    forget_cached_states(local_engine)
    plain = client.post("/extract", json={"prompts": [{"token_ids": ids}]}, headers=AUTH_A)
    assert plain.status_code == 200, plain.text
    reference = stored(client, plain.json()["objects"][0]["key"])["hidden_states"]
    states = tensors["hidden_states"]
    assert states.dtype == torch.float32
    assert states.shape == reference.shape
    error = ((states - reference).abs().max() / reference.abs().max()).item()
    assert error <= 1e-5, error
    assert not local_engine.unfinished()


def test_custom_id_row_is_generated_once(local_engine: ServerThread, client: httpx.Client) -> None:
    prompt = {"messages": MULTI, "custom_id": "regen-once"}
    first = regenerate(client, [prompt])
    assert first.status_code == 200, first.text
    count = engine_requests()
    again = regenerate(client, [prompt])
    assert again.status_code == 200, again.text
    assert engine_requests() == count  # found: the engine did not run
    (obj,) = again.json()["objects"]
    assert obj["status"] == "found"
    assert obj["key"] == first.json()["objects"][0]["key"]
    assert obj["regenerated"]["token_ids"] == first.json()["objects"][0]["regenerated"]["token_ids"]
    assert obj["regenerated"]["messages"] == first.json()["objects"][0]["regenerated"]["messages"]
    other = regenerate(client, [prompt], regenerate={"max_tokens": 8})
    assert other.status_code == 409, other.text
    assert "other settings" in other.json()["objects"][0]["error"]["message"]


LONG_USER = " ".join(["word"] * 600)


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "no user"),
        ([{"role": "user", "content": LONG_USER}], "max_model_len"),
    ],
    ids=["no-user-turn", "turn-over-max-model-len"],
)
def test_bad_conversation_is_refused_and_nothing_stored(
    local_engine: ServerThread, client: httpx.Client, messages: list[dict[str, str]], words: str
) -> None:
    root = local_engine.root  # type: ignore[attr-defined]
    before = objects_under(root, "team-a")
    good = {"messages": SINGLE}
    response = regenerate(client, [good, {"messages": messages}])
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["index"] == 1
    assert error["field"].startswith("prompts[1]")
    assert words in error["message"]
    assert objects_under(root, "team-a") == before
    assert not local_engine.unfinished()


def test_turn_that_outgrows_max_model_len_mid_conversation_stores_nothing(
    local_engine: ServerThread, client: httpx.Client
) -> None:
    """The second turn's prompt only overflows once the first answer exists: the prompt
    fails with its reason, and no object is stored for it."""
    half = " ".join(["word"] * 200)
    messages = [
        {"role": "user", "content": half},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": half},
    ]
    root = local_engine.root  # type: ignore[attr-defined]
    before = objects_under(root, "team-a")
    response = client.post(
        "/extract",
        json={"prompts": [{"messages": messages}], "regenerate": {"max_tokens": 64}},
        headers=AUTH_A,
    )
    assert response.status_code == 422, response.text
    assert "max_model_len" in response.text
    assert objects_under(root, "team-a") == before
    assert not local_engine.unfinished()


def conversations(count: int) -> list[dict[str, Any]]:
    """Rows of two assistant turns each, a custom_id apiece."""
    return [
        {
            "custom_id": f"conv-{i}",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question number {i}: what comes next?"},
                {"role": "assistant", "content": "An answer to replace."},
                {"role": "user", "content": f"And after {i}?"},
            ],
        }
        for i in range(count)
    ]


def run_cli(url: str, key: str, source: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "service", "dataset", "run", str(source), "--endpoint", url,
        "--output", str(out), "--regenerate", "--regenerate-max-tokens", "8",
        "--batch-size", "1", "--concurrency", "1", "--no-progress", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HSX_API_KEY": key, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def manifest(out: Path) -> list[dict[str, Any]]:
    path = out / "manifest.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def test_killed_regeneration_resumes_to_the_same_objects(
    local_url: str, local_engine: ServerThread, tmp_path: Path
) -> None:
    """Greedy ``hsx dataset run --regenerate`` killed (SIGKILL) mid-run and run again
    equals an uninterrupted run of the same rows (another namespace, so nothing is
    shared): the same token ids, masks and states. No row is generated twice: each
    row's object was created once (a row stored before the kill is ``found``, its
    forward tokens 0), and the manifest records the sampling settings."""
    rows = conversations(10)
    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_cli(local_url, KEY_A, source, whole).wait(600) == 0

    proc = run_cli(local_url, KEY_B, source, killed)
    deadline = time.monotonic() + 300
    while len(manifest(killed)) < 3:
        assert proc.poll() is None, "the run ended before the kill point"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    first = {r["row"]: r for r in manifest(killed)}
    assert 3 <= len(first) < len(rows)
    assert run_cli(local_url, KEY_B, source, killed).wait(600) == 0

    lines = manifest(killed)
    created = [r["row"] for r in lines if r["status"] == "ok" and not r["found"]]
    assert sorted(created) == sorted(set(created)), "a row was generated twice"
    for r in lines[len(first) :]:
        assert r["row"] not in first  # decided rows are not sent again
        if r["found"]:  # stored before the kill, its manifest line lost: not generated again
            assert r["forward_tokens"] == 0
    job = json.loads((killed / "job.json").read_text())
    assert job["fingerprint"]["regenerate"] == {
        "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0
    }  # fmt: skip
    assert job["provenance"]

    objects = {}
    for out, auth in ((whole, AUTH_A), (killed, {"Authorization": f"Bearer {KEY_B}"})):
        records = {r["row"]: r for r in manifest(out)}
        assert sorted(records) == list(range(len(rows)))
        with httpx.Client(base_url=local_url, timeout=60, headers=auth) as c:
            objects[out] = {
                row: load(c.get(f"/objects/{r['key']}").content) for row, r in records.items()
            }
    for row in range(len(rows)):
        a, b = objects[whole][row], objects[killed][row]
        assert a["token_ids"].tolist() == b["token_ids"].tolist()
        assert a["loss_mask"].tolist() == b["loss_mask"].tolist()
        assert torch.allclose(a["hidden_states"], b["hidden_states"], rtol=0, atol=1e-5)
    # The regenerated conversations beside each manifest hold the stored ids.
    regenerated = [json.loads(x) for x in (killed / "regenerated.jsonl").read_text().splitlines()]
    last = {x["row"]: x for x in regenerated}
    assert sorted(last) == list(range(len(rows)))
    for row, line in last.items():
        assert line["token_ids"] == objects[killed][row]["token_ids"].tolist()

    # A resume with other settings is refused in one line (exit 2) unless --force.
    before = (killed / "manifest.jsonl").read_bytes()
    refused = run_cli(local_url, KEY_B, source, killed, "--seed", "3")
    _, err = refused.communicate(timeout=300)
    assert refused.returncode == 2, err
    assert b"seed" in err
    assert b"--force" in err
    assert (killed / "manifest.jsonl").read_bytes() == before
