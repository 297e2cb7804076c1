"""The run's state without a server: stores (local, S3 on moto), manifest, fingerprint,
summary, and the command line's refusals of bad input."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.config import S3StorageSettings
from service.dataset.manifest import (
    Fingerprint,
    FingerprintMismatchError,
    Job,
    Record,
    check_fingerprint,
    dumps,
    load_records,
    summarise,
)
from service.dataset.store import RunStore

FINGERPRINT = Fingerprint(
    model="m",
    layer_ids=[1, 2],
    hidden_size=8,
    dtype="float32",
    codec="raw",
    loss="assistant",
    max_length=100,
    on_long="skip",
    max_tokens=1,
    include_output_tokens=False,
    hsx_version="0.1.0",
)


def test_local_log_survives_a_torn_last_line(tmp_path: Path) -> None:
    async def check() -> None:
        store = RunStore(str(tmp_path / "out"))
        assert await store.lines("manifest") == []
        assert not (tmp_path / "out").exists()  # nothing is created before the first write
        await store.append("manifest", ['{"a": 1}', '{"a": 2}'])
        with (tmp_path / "out" / "manifest.jsonl").open("a") as handle:
            handle.write('{"a": 3, "tor')  # a writer killed mid-line
        assert await store.lines("manifest") == ['{"a": 1}', '{"a": 2}']
        await store.append("manifest", ['{"a": 4}'])
        assert await store.lines("manifest") == ['{"a": 1}', '{"a": 2}', '{"a": 4}']
        await store.close()

    asyncio.run(check())


def test_s3_logs_are_parts_read_in_order(s3_endpoint: str, s3_bucket: str, s3_admin: Any) -> None:
    s3 = S3StorageSettings(endpoint_url=s3_endpoint, region="us-east-1")

    async def check() -> None:
        store = RunStore(f"s3://{s3_bucket}/runs/x", s3)
        await store.append("manifest", ["1", "2"])
        resumed = RunStore(f"s3://{s3_bucket}/runs/x", s3)  # a second session, later
        await resumed.append("manifest", ["3"])
        await store.append("manifest", [])
        assert await resumed.lines("manifest") == ["1", "2", "3"]
        listed = s3_admin.list_objects_v2(Bucket=s3_bucket, Prefix="runs/x/manifest/")
        assert listed["KeyCount"] == 2
        await store.write("job.json", b"{}")
        assert await store.read("job.json") == b"{}"
        assert await store.read("summary.json") is None
        root = RunStore(f"s3://{s3_bucket}/runs", s3)
        assert await root.children() == ["x"]
        for one in (store, resumed, root):
            await one.close()

    asyncio.run(check())


def test_the_last_line_of_a_row_wins(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    failed = Record(row=3, custom_id="c", status="failed", reason="gave_up", retryable=True)
    ok = Record(row=3, custom_id="c", status="ok", key="k", num_tokens=5, bytes=10, sha256="s")
    asyncio.run(store.append("manifest", [failed.model_dump_json(), ok.model_dump_json()]))
    records = asyncio.run(load_records(store))
    assert records[3].status == "ok"
    assert not failed.final
    assert ok.final


def test_summary_adds_up_and_is_incomplete_while_rows_are_pending() -> None:
    records = {
        0: Record(row=0, custom_id="a", status="ok", num_tokens=4, num_loss_tokens=2, bytes=9),
        1: Record(row=1, custom_id="b", status="skipped", reason="too_long: 300 > 255"),
        2: Record(row=2, custom_id="c", status="failed", reason="malformed: no prompt column"),
    }
    done = summarise(records, 3, None)
    assert (done.ok, done.skipped, done.failed, done.pending, done.complete) == (1, 1, 1, 0, True)
    assert done.reasons == {"malformed": 1, "too_long": 1}
    assert (done.tokens, done.loss_tokens, done.bytes) == (4, 2, 9)
    stopped = summarise(records, 5, "every endpoint failed")
    assert stopped.pending == 2
    assert not stopped.complete


def test_a_different_fingerprint_is_refused_unless_forced(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    job = Job(fingerprint=FINGERPRINT, input="x", input_rows=1)
    asyncio.run(store.write("job.json", dumps(job)))
    asyncio.run(check_fingerprint(store, FINGERPRINT, force=False))
    other = FINGERPRINT.model_copy(update={"dtype": "bfloat16", "max_length": 50})
    with pytest.raises(FingerprintMismatchError) as caught:
        asyncio.run(check_fingerprint(store, other, force=False))
    assert "dtype: 'float32' -> 'bfloat16', max_length: 100 -> 50" in str(caught.value)
    asyncio.run(check_fingerprint(store, other, force=True))


class NotHsx(BaseHTTPRequestHandler):
    """A real HTTP server that is something else (an OpenAI-style model list)."""

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "gpt", "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def not_hsx() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotHsx)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["dataset", *args])
    return code, capsys.readouterr().err


def test_an_endpoint_that_is_not_hsx(
    not_hsx: str, chats: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, err = run_cli(capsys, "run", str(chats), "--endpoint", not_hsx, "--output", str(out))
    assert code == 2
    assert err.splitlines() == [
        f"hsx dataset: error: {not_hsx}: not an hsx server (GET /v1/models gave 200 without "
        "layer_ids, or GET /version has no version)"
    ]
    assert not out.exists()


def test_no_endpoint_answers(
    chats: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = tmp_path / "out"
    code, err = run_cli(capsys, "run", str(chats), "--endpoint", url, "--output", str(out))
    assert code == 2
    assert err.startswith(f"hsx dataset: error: no endpoint answers: {url}: cannot connect")
    assert len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ('{"question": "a"}\n', "no prompt column; found ['question']"),
        ("garbage\n", "the first line is not JSON"),
    ],
)
def test_unusable_input_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "in.jsonl"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out"
    # The input is checked before any endpoint is asked: no server needed to refuse it.
    code, err = run_cli(
        capsys, "run", str(path), "--endpoint", "http://127.0.0.1:9", "--output", str(out)
    )
    assert code == 2
    assert len(err.splitlines()) == 1
    assert message in err
    assert not out.exists()


def test_bad_options_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "run", "x.jsonl", "--endpoint", "http://h", "--output", "o",
                        "--shard", "4/4")  # fmt: skip
    assert code == 2
    assert err.splitlines() == ["hsx dataset: error: Value error, shard 4/4: need 0 <= I < N"]


def test_verify_of_an_output_that_is_not_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(capsys, "verify", str(tmp_path), "--endpoint", "http://127.0.0.1:9")
    assert code == 2
    assert "no job.json (not the output of hsx dataset run)" in err


def test_inputs_in_s3_are_read_like_local_files(
    s3_endpoint: str, s3_bucket: str, s3_admin: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    from service.dataset.inputs import InputError, iter_rows, open_source

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    s3_admin.put_object(Bucket=s3_bucket, Key="in/chats.jsonl", Body=b'{"text": "a"}\n{"x": 1}\n')
    rows = list(iter_rows(open_source(f"s3://{s3_bucket}/in/chats.jsonl")))
    assert [r.prompt for r in rows] == [{"text": "a"}, None]
    with pytest.raises(InputError, match="cannot download it"):
        open_source(f"s3://{s3_bucket}/in/missing.jsonl")


def test_the_progress_line_says_what_a_user_watches() -> None:
    from service.dataset.progress import Counters

    counters = Counters(expected=100, ok=40, failed=2, skipped=8, tokens=4000, bytes=4_000_000)
    line = counters.line()
    assert line.startswith("done 40 failed 2 skipped 8 of ~100 | ")
    assert "4.0 MB written" in line
    # 90 rows will hold objects, at the 100 kB each seen so far.
    assert counters.projected_bytes() == 9_000_000
    assert line.endswith("projected 9.0 MB")
    assert Counters(expected=5).projected_bytes() is None
