"""``hsx dataset`` as users run it: real ``hsx serve`` processes on S3 (moto), the CLI in
its own process, a replica killed and the client killed mid-run, then verify and export."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import S3StorageSettings
from service.dataset.inputs import iter_rows, open_source
from service.dataset.store import RunStore
from tests.dataset.synth import make
from tests.support.processes import free_port, hsx_env, wait_ready

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.system]
KEY = "dataset-team-key-0123456789"
NAMESPACE = "ds"
ROWS = 600  # the kill-and-resume run's input rows


@contextlib.contextmanager
def hsx_server(cwd: Path, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``python -m service serve`` in its own process group (so a kill takes its engine)."""
    port = free_port()
    cwd.mkdir(parents=True, exist_ok=True)
    with (cwd / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            cwd=cwd,
            env=hsx_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        yield proc, url
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Any, s3_endpoint: str
) -> Iterator[dict[str, Any]]:
    """Two replicas of the tiny model writing to one S3 bucket."""
    import boto3

    bucket = "hsx-dataset-e2e"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("dataset-e2e")
    model = model_dir("llama")
    env = {
        "HSX_ENGINE__MODEL": str(model),
        "HSX_ENGINE__DTYPE": "float32",
        "HSX_ENGINE__MAX_MODEL_LEN": "256",
        "HSX_ENGINE__EXTRA_ARGS": '{"enforce_eager": true}',
        "HSX_ENGINE__CPU_KVCACHE_SPACE_GIB": "1",
        "HSX_STORAGE__URL": f"s3://{bucket}/data",
        "HSX_STORAGE__S3__ENDPOINT_URL": s3_endpoint,
        "HSX_STORAGE__S3__REGION": "us-east-1",
        "HSX_SERVER__API_KEYS": f"{NAMESPACE}:{KEY}",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    with (
        hsx_server(root / "a", env) as (proc_a, url_a),
        hsx_server(root / "b", env) as (proc_b, url_b),
    ):
        wait_ready(url_a, proc_a, root / "a" / "serve.log")
        wait_ready(url_b, proc_b, root / "b" / "serve.log")
        yield {
            "a": url_a,
            "b": url_b,
            "proc_b": proc_b,
            "s3": s3,
            "bucket": bucket,
            "s3_endpoint": s3_endpoint,
            "root": root,
            "model": str(model),
        }
    s3.close()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "service", "dataset", *args]


def cli_env() -> dict[str, str]:
    return {**os.environ, "HSX_API_KEY": KEY, "PYTHONPATH": str(Path(__file__).parents[2])}


def lines(store: RunStore, log: str) -> list[str]:
    return asyncio.run(store.lines(log))


def manifest_rows(store: RunStore) -> int:
    return len(lines(store, "manifest"))


def wait_rows(store: RunStore, rows: int, proc: subprocess.Popen[bytes], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while manifest_rows(store) < rows:
        assert proc.poll() is None, "the run ended before reaching the kill point"
        assert time.monotonic() < deadline, f"fewer than {rows} manifest rows in {limit_s} s"
        time.sleep(0.2)


def namespace_keys(s3: Any, bucket: str) -> list[str]:
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"data/hsx/{NAMESPACE}/"
    ):
        keys += [o["Key"].removeprefix("data/") for o in page.get("Contents", [])]
    return keys


def test_two_replicas_one_killed_client_killed_resumes_and_verifies(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    # 600 rows: a malformed one every 100 (6, every kind in synth.MALFORMED), a long one
    # every 40; the replica dies after 90 manifest rows, the client after 270.
    data = make(ROWS, seed=7, malformed_every=100)
    source = data.write_jsonl(tmp_path / "chats.jsonl")
    output = f"s3://{cluster['bucket']}/runs/chats"
    store = RunStore(output, S3StorageSettings(endpoint_url=cluster["s3_endpoint"]))
    command = cli(
        "run", str(source), "--endpoint", cluster["a"], "--endpoint", cluster["b"],
        "--output", output, "--s3-endpoint-url", cluster["s3_endpoint"],
        "--loss", "assistant", "--concurrency", "2", "--batch-size", "4",
        "--max-consecutive-errors", "4", "--no-progress",
    )  # fmt: skip
    log = (tmp_path / "run1.log").open("wb")
    first = subprocess.Popen(command, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_rows(store, ROWS * 15 // 100, first, limit_s=400)
        kill_group(cluster["proc_b"])  # a replica dies mid-run, engine and all
        wait_rows(store, ROWS * 45 // 100, first, limit_s=400)
        first.kill()  # and so does the client
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    before = manifest_rows(store)
    assert ROWS * 45 // 100 <= before < ROWS

    second = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "cannot connect" in second.stderr  # the dead replica was left out
    summary = json.loads(asyncio.run(store.read("summary.json")) or b"{}")
    assert summary["input_rows"] == ROWS
    assert summary["ok"] + summary["failed"] + summary["skipped"] == ROWS
    assert summary["ok"] == len(data.valid)
    assert summary["skipped"] == len(data.long)
    assert summary["failed"] == len(data.malformed)
    assert summary["complete"] is True

    # The manifest: one final row per input row; ok rows exactly the valid ones.
    records: dict[int, dict[str, Any]] = {}
    for line in lines(store, "manifest"):
        row = json.loads(line)
        records[row["row"]] = row
    ok = {r["row"]: r for r in records.values() if r["status"] == "ok"}
    assert set(ok) == data.valid
    keys = [r["key"] for r in ok.values()]
    assert len(set(keys)) == len(keys)
    # No duplicates, no orphans: the namespace holds exactly the manifest's objects,
    # although one replica died with requests in flight and the client was killed.
    assert sorted(namespace_keys(cluster["s3"], cluster["bucket"])) == sorted(keys)

    errors = [json.loads(line) for line in lines(store, "errors")]
    reasons = {e["row"]: e["reason"] for e in errors}
    assert {r for r in reasons if reasons[r].startswith("too_long")} == data.long
    assert {r for r in reasons if reasons[r].startswith("malformed")} == data.malformed
    assert "not JSON" in reasons[min(data.malformed)]

    # Per-layer statistics of every ok row, across both sessions (from the manifest),
    # found objects (rows retried after the kill) included.
    stats = json.loads(asyncio.run(store.read("statistics.json")) or b"{}")
    assert stats["objects"] == summary["ok"]
    assert stats["tokens"] == summary["tokens"]

    verify = subprocess.run(
        cli("verify", output, "--endpoint", cluster["a"], "--s3-endpoint-url",
            cluster["s3_endpoint"], "--parity", "8", "--parity-model", cluster["model"]),
        env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"verified {len(data.valid)} objects" in verify.stdout
    assert "0 problems" in verify.stdout
    assert "re-rendered 8 messages rows" in verify.stdout  # token drift, both replicas' rows
    parity = json.loads(asyncio.run(store.read("parity.json")) or b"{}")  # on S3 too
    assert len(parity["rows"]) == 8
    assert all(layer["ok"] for row in parity["rows"] for layer in row["layers"])

    export_and_read_with_speculators(cluster, output, tmp_path / "export", ok)


def export_and_read_with_speculators(
    cluster: dict[str, Any], output: str, dest: Path, ok: dict[int, dict[str, Any]]
) -> None:
    from safetensors.torch import load

    exported = subprocess.run(
        cli("export", output, str(dest), "--format", "speculators", "--endpoint", cluster["a"],
            "--s3-endpoint-url", cluster["s3_endpoint"]),
        env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stdout + exported.stderr
    data = pytest.importorskip("speculators.train.data")
    dataset = data.ArrowDataset(max_len=256, datapath=str(dest), on_missing="raise")
    assert len(dataset) == len(ok)
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(follow_redirects=True, headers=auth, timeout=60) as client:
        for index, row in enumerate(sorted(ok)):
            sample = dataset[index]
            stored = load(client.get(f"{cluster['a']}/objects/{ok[row]['key']}").content)
            assert sample["input_ids"].tolist() == stored["token_ids"].tolist()
            assert sample["loss_mask"].tolist() == stored["loss_mask"].tolist()
            assert int(sample["loss_mask"].sum()) == ok[row]["num_loss_tokens"] > 0
            assert sample["verifier_last_hidden_states"].equal(stored["hidden_states"][:, -1])
    freq = __import__("torch").load(dest / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == sum(r["num_loss_tokens"] for r in ok.values())


def test_shards_cover_every_row_once_and_fingerprints_guard_outputs(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    data = make(60, seed=3, long_every=1000, malformed_every=1000)
    source = data.write_jsonl(tmp_path / "small.jsonl")
    output = tmp_path / "sharded"
    for index in range(4):
        done = subprocess.run(
            cli("run", str(source), "--endpoint", cluster["a"], "--output", str(output),
                "--shard", f"{index}/4", "--loss", "last_turn", "--no-progress"),
            env=cli_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    rows: list[int] = []
    for shard in sorted(output.glob("shard-*-of-00004")):
        rows += [json.loads(line)["row"] for line in (shard / "manifest.jsonl").open()]
    assert sorted(rows) == list(range(60))  # every row exactly once across the shards
    verify = subprocess.run(
        cli("verify", str(output), "--endpoint", cluster["a"]),
        env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verified 60 objects" in verify.stdout

    # Another loss mode on the same output: refused, one line, nothing written.
    shard0 = output / "shard-00000-of-00004"
    before = {p.name: p.read_bytes() for p in shard0.iterdir()}
    refused = subprocess.run(
        cli("run", str(source), "--endpoint", cluster["a"], "--output", str(output),
            "--shard", "0/4", "--loss", "all", "--no-progress"),
        env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "hsx dataset: shard 0/4 from --shard",
        f"hsx dataset: error: {shard0} holds a run with other settings "
        "(loss: 'last_turn' -> 'all'); use another --output, or --force to continue it anyway",
    ]
    assert {p.name: p.read_bytes() for p in shard0.iterdir()} == before
    ids = {row.index: row.custom_id for row in iter_rows(open_source(source))}
    assert len(set(ids.values())) == 60


def chat_line(custom_id: str, role: Any, text: str = "say hello") -> dict[str, Any]:
    body = {"messages": [{"role": role, "content": text}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


#: 100,000 brackets deep: valid JSON that no reader of Python's can recurse into.
DEEP = "[" * 100_000 + "]" * 100_000


def hostile_inputs() -> dict[str, tuple[list[str], dict[int, str]]]:
    """Batch API and plain JSONL inputs, each ten good lines among hostile ones: the
    lines, and the reason each hostile row must end with."""
    batch = [json.dumps(chat_line(f"b{i}", "user", f"say {i}")) for i in range(10)]
    batch[2:2] = [json.dumps(chat_line("list-role", ["user"]))]
    batch[5:5] = [json.dumps(chat_line("dict-role", {"role": "user"}))]
    batch[8:8] = [json.dumps(chat_line("deep", "user")).replace('"say hello"', DEEP)]
    native = [json.dumps({"custom_id": f"n{i}", "messages": [{"role": "user", "content": f"{i}"}]})
              for i in range(10)]  # fmt: skip
    native[4:4] = ['{"custom_id": "deep", "messages": ' + DEEP + "}"]
    roles = "one of ['assistant', 'system', 'tool', 'user']"
    too_deep = "malformed: nested too deep to read (Python's recursion limit)"
    reasons = {
        2: f"malformed: row 2 (custom_id 'list-role'): body.messages[0].role ['user']: {roles}",
        5: "malformed: row 5 (custom_id 'dict-role'): body.messages[0].role {'role': 'user'}: "
        + roles,
        8: too_deep,
    }
    return {"batch": (batch, reasons), "native": (native, {4: too_deep})}


@pytest.mark.parametrize("kind", ["batch", "native"])
def test_hostile_lines_fail_alone_and_the_run_and_its_resume_finish(
    cluster: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    """Issue 58 (M3, L6): a list role, a dict role, a line nested 100,000 deep once
    stopped the whole run (exit 1, ok 0), and every resume at the same line."""
    lines, reasons = hostile_inputs()[kind]
    source = tmp_path / f"{kind}.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out"
    command = cli("run", str(source), "--endpoint", cluster["a"], "--output", str(output),
                  "--no-progress")  # fmt: skip
    for session in ("run", "resume"):
        done = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (session, done.stdout[-3000:] + done.stderr[-3000:])
    summary = json.loads((output / "summary.json").read_text())
    assert (summary["ok"], summary["failed"], summary["pending"]) == (10, len(reasons), 0)
    assert summary["complete"] is True
    records = [json.loads(x) for x in (output / "manifest.jsonl").read_text().splitlines()]
    assert len(records) == len(lines)  # the resume decided nothing again
    failed = {r["row"]: r["reason"] for r in records if r["status"] == "failed"}
    assert failed == reasons
    ok = [r for r in records if r["status"] == "ok"]
    assert all(r["num_tokens"] > 0 and r["key"].startswith(f"hsx/{NAMESPACE}/") for r in ok)
