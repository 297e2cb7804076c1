"""The runner's handling of faults a real server produces only by chance (429 under
load, 503 while draining, one bad prompt in a batch), injected by scripted hsx stand-ins
over real HTTP. The real servers are in test_dataset_e2e.py."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from service.dataset import RunOptions, run_dataset
from tests.dataset.standins import Reply, stored


def rows_file(tmp_path: Path, count: int, long: set[int] = frozenset()) -> Path:  # type: ignore[assignment]
    path = tmp_path / "rows.jsonl"
    lines = [
        json.dumps({"token_ids": list(range(3, 3 + (100 if i in long else 5 + i % 7))), "n": i})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def options(tmp_path: Path, urls: list[str], **extra: Any) -> RunOptions:
    return RunOptions(
        input=str(rows_file(tmp_path, 40, long={7})),
        endpoints=urls,
        output=str(tmp_path / "out"),
        progress=False,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        **extra,
    )


def manifest(tmp_path: Path) -> dict[int, dict[str, Any]]:
    lines = (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()
    return {json.loads(line)["row"]: json.loads(line) for line in lines}


def test_a_busy_endpoint_is_left_alone_for_retry_after(tmp_path: Path, servers: Any) -> None:
    busy = servers(lambda body: (429, {"Retry-After": "60"}, {"error": {"type": "overloaded"}}))
    good = servers(stored)
    summary = run_dataset(options(tmp_path, [busy.url, good.url], concurrency=2))
    assert (summary.ok, summary.skipped, summary.failed, summary.complete) == (39, 1, 0, True)
    # Each of the busy endpoint's two workers asked once, then waited out Retry-After
    # while the other endpoint did all the work (the prompts went back to the queue).
    assert len(busy.bodies) == 2
    assert good.prompts() == 39
    assert manifest(tmp_path)[7]["reason"] == "too_long: 100 > 63"


def test_a_failing_endpoint_is_dropped_and_its_prompts_go_elsewhere(
    tmp_path: Path, servers: Any
) -> None:
    third_failure = threading.Event()

    def failing(body: dict[str, Any]) -> Reply:
        if len(down.bodies) >= 3:
            third_failure.set()
        return 503, {}, {"error": {"type": "unavailable", "message": "x"}}

    def after_the_drop(body: dict[str, Any]) -> Reply:
        third_failure.wait(30)  # hold the healthy one until the other has failed 3 times
        return stored(body)

    down = servers(failing)
    good = servers(after_the_drop)
    summary = run_dataset(
        options(tmp_path, [down.url, good.url], max_consecutive_errors=3, concurrency=1)
    )
    assert (summary.ok, summary.complete) == (39, True)
    assert len(down.bodies) == 3  # dropped after three errors in a row, never asked again
    sent = [p["custom_id"] for b in good.bodies for p in b["prompts"]]
    assert len(sent) == len(set(sent)) == 39  # each prompt stored once


def test_a_run_whose_servers_are_gone_stops_then_resumes(tmp_path: Path, servers: Any) -> None:
    calls = {"n": 0}

    def flaky(body: dict[str, Any]) -> Reply:
        calls["n"] += 1
        if calls["n"] > 2:  # two batches stored, then the server "dies"
            return 503, {}, {"error": {"type": "engine_unavailable", "message": "dead"}}
        return stored(body)

    server = servers(flaky)
    first = run_dataset(options(tmp_path, [server.url], concurrency=1, max_consecutive_errors=4))
    assert first.stopped is not None
    assert "every endpoint failed 4 times in a row" in first.stopped
    assert not first.complete
    assert first.ok == 16
    assert first.ok + first.failed + first.skipped + first.pending == 40
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["pending"] == first.pending

    healthy = servers(stored)
    second = run_dataset(options(tmp_path, [healthy.url]))
    assert (second.ok, second.skipped, second.complete) == (39, 1, True)
    resent = {p["custom_id"] for b in healthy.bodies for p in b["prompts"]}
    done_before = {r["custom_id"] for r in manifest(tmp_path).values() if r.get("key")}
    assert len(resent) == 39 - 16  # only what the manifest did not hold
    assert len(done_before) == 39


def test_one_refused_prompt_fails_alone(tmp_path: Path, servers: Any) -> None:
    def picky(body: dict[str, Any]) -> Reply:
        for index, prompt in enumerate(body["prompts"]):
            if prompt["token_ids"][-1] == 3 + 5 + 3 - 1:  # rows with 8 tokens
                error = {"type": "invalid_request", "message": f"prompts[{index}]: no",
                         "field": f"prompts[{index}]", "index": index}  # fmt: skip
                return 422, {}, {"error": error}
        return stored(body)

    server = servers(picky)
    summary = run_dataset(options(tmp_path, [server.url]))
    refused = {row for row, r in manifest(tmp_path).items() if r["status"] == "failed"}
    assert refused == {i for i in range(40) if 5 + i % 7 == 8 and i != 7}
    assert summary.ok == 40 - 1 - len(refused)
    assert all(
        manifest(tmp_path)[row]["reason"].startswith("refused: 422 invalid_request: prompts[")
        for row in refused
    )
    errors = (tmp_path / "out" / "errors.jsonl").read_text().splitlines()
    assert len(errors) == len(refused) + 1


def test_truncate_cuts_token_rows_to_the_limit(tmp_path: Path, servers: Any) -> None:
    server = servers(stored)
    summary = run_dataset(options(tmp_path, [server.url], max_length=20, on_long="truncate"))
    assert (summary.ok, summary.skipped) == (40, 0)
    assert manifest(tmp_path)[7]["num_tokens"] == 20
    lengths = {len(p["token_ids"]) for b in server.bodies for p in b["prompts"]}
    assert max(lengths) == 20


def test_estimate_tokenises_a_sample_and_writes_nothing(tmp_path: Path, servers: Any) -> None:
    from service.dataset import estimate_dataset

    server = servers(stored)
    chats = tmp_path / "chats.jsonl"
    turn = {"role": "user", "content": "hello there"}
    chats.write_text("".join(json.dumps({"messages": [turn], "n": i}) + "\n" for i in range(30)))
    run = RunOptions(input=str(chats), endpoints=[server.url], output=str(tmp_path / "out"))
    server.tokenize = lambda body: (200, {}, {"count": 12, "max_model_len": 64, "tokens": []})
    result = estimate_dataset(run, sample=10)
    assert (result.rows, result.sampled, result.projected_tokens) == (30, 10, 360)
    # [tokens, 2 layers, 4 wide] float32 states + int64 token ids per token.
    assert result.projected_bytes == 360 * (2 * 4 * 4 + 8)
    assert server.tokenized[0] == {
        "model": "tiny", "messages": [turn], "add_generation_prompt": True
    }  # fmt: skip
    assert server.bodies == []
    assert not (tmp_path / "out").exists()


def test_estimate_needs_tokenize(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    server = servers(stored)
    path = rows_file(tmp_path, 3)
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a"}\n')
    code = main(["dataset", "run", str(text), "--endpoint", server.url, "--output",
                 str(tmp_path / "out"), "--estimate"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"hsx dataset: error: {server.url} has no POST /tokenize; cannot estimate"
    )
    assert path.exists()
    assert not (tmp_path / "out").exists()


def safetensors_object(ids: list[int], states: Any = None) -> bytes:
    import torch
    from safetensors.torch import save

    hidden = torch.ones(len(ids), 2, 4) if states is None else states
    return bytes(save({"hidden_states": hidden, "token_ids": torch.tensor(ids)}))


def test_verify_reports_every_kind_of_problem(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from service.cli import main

    def storing(body: dict[str, Any]) -> Reply:
        status, headers, reply = stored(body)
        for obj, prompt in zip(reply["objects"], body["prompts"], strict=True):
            data = safetensors_object(prompt["token_ids"])
            server.objects[obj["key"]] = data
            obj.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        return status, headers, reply

    server = servers(storing)
    run = options(tmp_path, [server.url])
    assert run_dataset(run).complete
    out = str(tmp_path / "out")
    assert main(["dataset", "verify", out, "--endpoint", server.url]) == 0
    assert "verified 39 objects of 40 manifest rows (0 failed, 1 skipped rows): 0 problems" in (
        capsys.readouterr().out
    )

    rows = manifest(tmp_path)
    key = {row: r.get("key") for row, r in rows.items()}
    del server.objects[key[0]]  # gone
    server.objects[key[1]] = server.objects[key[1]][:-4] + b"\0\0\0\0"  # bytes changed
    nan = torch.ones(rows[2]["num_tokens"], 2, 4)
    nan[0, 0, 0] = float("nan")
    server.objects[key[2]] = safetensors_object(list(range(3, 3 + rows[2]["num_tokens"])), nan)
    other = safetensors_object([9] * rows[3]["num_tokens"])  # other token ids
    server.objects[key[3]] = other
    fixed = [  # the manifest says these checksums, so only the contents are wrong
        {**rows[2], "sha256": hashlib.sha256(server.objects[key[2]]).hexdigest()},
        {**rows[3], "sha256": hashlib.sha256(other).hexdigest()},
    ]
    with (tmp_path / "out" / "manifest.jsonl").open("a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in fixed))
    assert main(["dataset", "verify", out, "--endpoint", server.url]) == 1
    report = capsys.readouterr().out.splitlines()
    assert report[0].endswith(": 4 problems")
    assert sorted(report[1:]) == sorted([
        f"row 0 ({key[0]}): GET answered 404",
        f"row 1 ({key[1]}): checksum differs from the manifest",
        f"row 2 ({key[2]}): hidden_states hold NaN or Inf",
        f"row 3 ({key[3]}): token_ids differ from the input row",
    ])  # fmt: skip


# ---------------------------------------------------------------- the CLI's one-line refusals
# (issue 26, finding 10: these were 30-45-line tracebacks)


@pytest.mark.parametrize("where", ["a-file", "under-a-file", "unwritable"])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    from service.cli import main

    server = servers(stored)
    source = rows_file(tmp_path, 5)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    if where == "a-file":
        out, problem = blocker, "is a file, not a directory"
    elif where == "under-a-file":
        out, problem = blocker / "run", f"{blocker} is a file"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out, problem = locked / "run", f"{locked} is not writable"
        if os.access(locked, os.W_OK):  # root: no permission stops it, a kernel fs does
            if not Path("/sys/kernel").is_dir():
                pytest.skip("running as root without /sys: no unwritable directory to use")
            out, problem = Path("/sys/hsx-dataset-test/run"), "cannot write job.json: "
    started = time.monotonic()
    code = main(["dataset", "run", str(source), "--endpoint", server.url, "--output", str(out),
                 "--no-progress"])  # fmt: skip
    assert time.monotonic() - started < 60
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"hsx dataset: error: --output {out}: {problem}")
    assert blocker.read_text() == "not a directory\n"  # untouched
    assert out == blocker or not out.exists()
    assert server.bodies == []


def masked_object(ids: list[int]) -> bytes:
    import torch
    from safetensors.torch import save

    tensors = {"hidden_states": torch.ones(len(ids), 2, 4), "token_ids": torch.tensor(ids),
               "loss_mask": torch.ones(len(ids), dtype=torch.int64)}  # fmt: skip
    return bytes(save(tensors))


def test_export_into_a_file_is_one_line_and_exit_2(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    server = servers(stored)
    assert run_dataset(options(tmp_path, [server.url], loss="assistant")).complete
    target = tmp_path / "a-file"
    target.write_text("keep me\n")
    for dest, problem in [
        (target, "is a file, not a directory"),
        (target / "export", f"{target} is a file"),
    ]:
        code = main(["dataset", "export", str(tmp_path / "out"), str(dest), "--endpoint",
                     server.url])  # fmt: skip
        assert code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"hsx dataset: error: export target {dest}: {problem}; export into a new directory"
        ]
    assert target.read_text() == "keep me\n"


def test_export_of_an_unfinished_run_names_its_undecided_rows(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    calls = {"n": 0}

    def two_batches_then_down(body: dict[str, Any]) -> Reply:
        calls["n"] += 1  # one request at a time (concurrency 1)
        if calls["n"] > 2:
            return 503, {}, {"error": {"type": "engine_unavailable", "message": "dead"}}
        status, headers, reply = stored(body)
        for obj, prompt in zip(reply["objects"], body["prompts"], strict=True):
            data = masked_object(prompt["token_ids"])
            server.objects[obj["key"]] = data
            obj.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        return status, headers, reply

    server = servers(two_batches_then_down)
    run = options(tmp_path, [server.url], loss="assistant", concurrency=1,
                  max_consecutive_errors=2)  # fmt: skip
    summary = run_dataset(run)
    assert (summary.ok, summary.skipped, summary.pending, summary.complete) == (16, 1, 23, False)
    capsys.readouterr()  # the run's own stopping lines
    out, dest = str(tmp_path / "out"), tmp_path / "export"
    command = ["dataset", "export", out, str(dest), "--endpoint", server.url]

    assert main(command) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"hsx dataset: error: {out}: 23 of 40 input rows are undecided (not sent yet, or "
        "failed with a retryable error); finish the run (run the same command again), or "
        "pass --allow-partial to export its 16 ok rows"
    ]
    assert not dest.exists()

    assert main([*command, "--allow-partial"]) == 0
    captured = capsys.readouterr()
    # (then datasets' own "Saving the dataset" progress bar)
    assert captured.err.splitlines()[0] == (
        f"hsx dataset: warning: {out}: 23 of 40 input rows are undecided (not sent yet, or "
        "failed with a retryable error); exporting the 16 ok rows"
    )
    assert "Traceback" not in captured.err
    assert captured.out.strip() == f"exported 16 samples to {dest}"
    assert len(list((dest / "hidden_states").glob("hs_*.safetensors"))) == 16
