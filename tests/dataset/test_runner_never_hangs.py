"""``hsx dataset run`` always ends (issue 26, finding 4): rows holding lone surrogates, an
endpoint answering 200 with a proxy's HTML page, exceptions injected at random into the
workers, a worker that dies, rows a bug loses, a manifest that cannot be written. Each
run ends with exit 0, 1 or 2 within a bound, every row decided (with its reason) or
pending (with the run's stop reason), stderr holding only one-line messages.

The faults come from scripted hsx stand-ins over real HTTP (``tests/dataset/standins.py``)
and from wrappers this module puts around the runner's own functions (monkeypatch);
production code has no hook for them."""

from __future__ import annotations

import inspect
import json
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.dataset import cli as dataset_cli
from service.dataset import runner
from service.dataset.inputs import Row
from service.dataset.store import RunStore
from tests.dataset.cli_runs import LIMIT_S, dataset_run, read_manifest, read_summary, write_input
from tests.dataset.standins import Reply, stored

HTML = b"<html><body><h1>502 Bad Gateway</h1><p>nginx</p></body></html>"


def html(body: dict[str, Any]) -> Reply:
    """A proxy in front of a dead replica: 200, and its HTML page."""
    return 200, {"Content-Type": "text/html"}, HTML


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's backoff (0.5 s doubling to 30 s) shortened, so a test takes seconds."""
    options_of = dataset_cli.options_of
    fast = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}
    monkeypatch.setattr(dataset_cli, "options_of", lambda a: options_of(a).model_copy(update=fast))


def token_rows(count: int, start: int = 0) -> list[str]:
    return [
        json.dumps({"token_ids": [3, 4, 5 + i % 7, i + 10], "n": i + start}) for i in range(count)
    ]


#: Rows as they come in ShareGPT dumps: valid JSON, ``\\ud800`` escapes of lone surrogates
#: (``json.dumps`` writes them so). Each with the reason it must fail with.
SURROGATE_ROWS = [
    (
        {"text": "abc \ud800 def", "custom_id": "c-text"},
        "malformed: text is not valid UTF-8: a lone surrogate U+D800 at character 4",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "\udc00!"},
            ]
        },
        "malformed: messages[1] content is not valid UTF-8: a lone surrogate U+DC00 at character 0",
    ),
    (
        {"conversations": [{"from": "human", "value": "x\udfff"}], "custom_id": "c-sharegpt"},
        "malformed: conversations[0] content is not valid UTF-8: a lone surrogate U+DFFF "
        "at character 1",
    ),
    (
        {"token_ids": [1, 2, 3], "custom_id": "id-\ud83d"},
        "malformed: custom_id is not valid UTF-8: a lone surrogate U+D83D at character 3",
    ),
]


def stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("hsx dataset: ") for line in lines), lines  # no traceback
    return lines


def assert_accounted(tmp_path: Path, code: int, input_rows: int) -> dict[str, Any]:
    """Every row decided (one manifest line, a reason unless ok) or pending, and the exit
    code, summary.json and manifest agreeing."""
    summary = read_summary(tmp_path)
    lines = read_manifest(tmp_path)
    rows = [line["row"] for line in lines]
    assert len(rows) == len(set(rows)), "a row decided twice in one session"
    assert set(rows) <= set(range(input_rows))
    statuses = [line["status"] for line in lines]
    assert summary["input_rows"] == input_rows
    assert (summary["ok"], summary["failed"], summary["skipped"]) == (
        statuses.count("ok"),
        statuses.count("failed"),
        statuses.count("skipped"),
    )
    assert summary["pending"] == input_rows - len(rows)
    for line in lines:
        assert line["status"] == "ok" or line["reason"], line
    if summary["pending"]:
        assert summary["stopped"], "rows left pending without the run's reason"
    assert code == (0 if summary["complete"] else 1)
    return summary


# ---------------------------------------------------------------- lone surrogates


def test_lone_surrogates_are_malformed_rows_with_their_reason_not_a_hang(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    server = servers(stored)
    valid = token_rows(20)
    # A surrogate outside the prompt is not sent: the row is fine, and has an id.
    harmless = json.dumps({"token_ids": [7, 8, 9], "note": "\ud800"})
    bad = [json.dumps(raw) for raw, _ in SURROGATE_ROWS]
    assert all("\\ud" in line for line in bad)  # the escapes, as ShareGPT dumps hold them
    source = write_input(tmp_path / "chats.jsonl", valid[:10] + bad + [harmless] + valid[10:])

    code, elapsed = dataset_run(tmp_path, source, [server.url], "--batch-size", "4")
    assert elapsed < LIMIT_S
    assert code == 0
    assert stderr_lines(capsys) == []
    summary = assert_accounted(tmp_path, code, 25)
    assert (summary["ok"], summary["failed"], summary["reasons"]) == (21, 4, {"malformed": 4})
    failed = {line["row"]: line for line in read_manifest(tmp_path) if line["status"] != "ok"}
    assert sorted(failed) == [10, 11, 12, 13]
    for row, (raw, reason) in zip(sorted(failed), SURROGATE_ROWS, strict=True):
        assert failed[row]["reason"] == reason
        assert failed[row]["retryable"] is False
        if raw.get("custom_id") in ("c-text", "c-sharegpt"):  # named by its custom_id
            assert failed[row]["custom_id"] == raw["custom_id"]
        else:  # no usable custom_id: the content id, as for any row without one
            assert failed[row]["custom_id"].startswith("row-")
    errors = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").open()]
    assert {e["row"]: e["reason"] for e in errors} == {r: f["reason"] for r, f in failed.items()}
    assert server.prompts() == 21  # no malformed row reached the server

    # Resume: nothing is sent or decided again (the ids of rows without one are stable).
    before = (tmp_path / "out" / "manifest.jsonl").read_text()
    code, _ = dataset_run(tmp_path, source, [server.url])
    assert code == 0
    assert server.prompts() == 21
    assert (tmp_path / "out" / "manifest.jsonl").read_text() == before


def test_the_same_surrogate_row_without_custom_id_writes_a_decision_not_exit_2(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's second shape: it exited 2 without naming the row and left job.json."""
    server = servers(stored)
    source = write_input(
        tmp_path / "one.jsonl", [*token_rows(3), json.dumps({"text": "\ud800"}), *token_rows(2, 3)]
    )
    code, _ = dataset_run(tmp_path, source, [server.url])
    assert code == 0
    assert stderr_lines(capsys) == []
    summary = assert_accounted(tmp_path, code, 6)
    assert (summary["ok"], summary["failed"]) == (5, 1)
    (failed,) = [line for line in read_manifest(tmp_path) if line["status"] == "failed"]
    assert failed["row"] == 3
    assert failed["reason"] == (
        "malformed: text is not valid UTF-8: a lone surrogate U+D800 at character 0"
    )


def test_a_row_that_cannot_be_encoded_fails_alone_as_invalid_row(
    tmp_path: Path,
    servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Past the input checks (a reader that lets one through): the batch's other rows go on."""
    server = servers(stored)
    source = write_input(tmp_path / "rows.jsonl", token_rows(8))
    iter_rows = runner.iter_rows

    def leaky(source: Any, id_column: str = "custom_id") -> Any:
        for row in iter_rows(source, id_column):
            if row.index == 2:
                assert row.prompt is not None
                row = Row(row.index, "c2", prompt={**row.prompt, "note": "\ud800"})
            yield row

    monkeypatch.setattr(runner, "iter_rows", leaky)
    code, _ = dataset_run(tmp_path, source, [server.url], "--batch-size", "8", "--concurrency", "1")
    assert code == 0
    assert stderr_lines(capsys) == []
    assert_accounted(tmp_path, code, 8)
    by_row = {line["row"]: line for line in read_manifest(tmp_path)}
    assert by_row[2]["status"] == "failed"
    assert by_row[2]["custom_id"] == "c2"
    assert by_row[2]["reason"].startswith(
        "invalid_row: row 2 (c2) cannot be sent as JSON: UnicodeEncodeError: 'utf-8' codec "
        "can't encode character '\\ud800'"
    )
    assert by_row[2]["retryable"] is False
    assert all(by_row[r]["status"] == "ok" for r in range(8) if r != 2)
    assert len(server.bodies) == 1  # the other seven went in the same request
    assert server.prompts() == 7


# ---------------------------------------------------------------- 200 that is not JSON


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (HTML, "bad_response: 200 with a body that is not JSON (text/html): '<html><body>"),
        (b'{"objects": [{"ind', "bad_response: 200 with a body that is not JSON (text/html)"),
        (b"[]", "bad_response: 200 without an objects list (text/html): []"),
        (b'{"objects": [{"index": 0}]}', "bad_response: objects[0].key is missing or not str"),
        (b'{"objects": []}', "bad_response: 200 without any of the 8 prompts' objects"),
    ],
    ids=["html", "truncated", "a-list", "no-key", "no-objects"],
)
def test_an_endpoint_answering_200_with_the_wrong_body_stops_the_run_not_a_hang(
    tmp_path: Path,
    servers: Any,
    capsys: pytest.CaptureFixture[str],
    body: bytes,
    reason: str,
) -> None:
    proxy = servers(lambda _: (200, {"Content-Type": "text/html"}, body))
    source = write_input(tmp_path / "rows.jsonl", token_rows(20))
    code, elapsed = dataset_run(
        tmp_path, source, [proxy.url], "--max-consecutive-errors", "3", "--concurrency", "1"
    )
    assert elapsed < LIMIT_S
    assert code == 1
    summary = assert_accounted(tmp_path, code, 20)
    assert (summary["ok"], summary["pending"], summary["complete"]) == (0, 20, False)
    assert summary["stopped"].startswith("every endpoint failed 3 times in a row; last error: ")
    assert reason in summary["stopped"]
    assert len(proxy.bodies) == 3
    err = stderr_lines(capsys)
    assert len(err) == 3, err
    assert err[0].startswith(f"hsx dataset: warning: {proxy.url}: {reason}")
    assert err[1].startswith(f"hsx dataset: dropping {proxy.url} after 3 errors in a row (last: ")
    assert err[2] == f"hsx dataset: stopping: {summary['stopped']}"


def test_a_prompt_the_server_never_answers_runs_out_of_retries(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 200 that leaves out one prompt's object: that prompt is sent again, as an
    attempt, so it ends failed (retryable) instead of going round forever."""
    never = json.loads(token_rows(6)[4])["token_ids"]

    def all_but_one(body: dict[str, Any]) -> Reply:
        status, headers, reply = stored(body)
        prompts = body["prompts"]
        reply["objects"] = [
            o for o in reply["objects"] if prompts[o["index"]]["token_ids"] != never
        ]
        return status, headers, reply

    server = servers(all_but_one)
    source = write_input(tmp_path / "rows.jsonl", token_rows(6))
    code, elapsed = dataset_run(tmp_path, source, [server.url], "--retries", "3")
    assert elapsed < LIMIT_S
    assert code == 1
    summary = assert_accounted(tmp_path, code, 6)
    assert (summary["ok"], summary["failed"], summary["pending"]) == (5, 1, 0)
    (failed,) = [line for line in read_manifest(tmp_path) if line["status"] == "failed"]
    assert failed["row"] == 4
    # Left out of a batch, or (sent alone at the end) an answer without any object.
    assert failed["reason"] in {
        f"gave_up: 4 attempts, last: {server.url}: bad_response: 200 without {what}"
        for what in ("this prompt's object", "any of the 1 prompts' objects")
    }
    assert failed["retryable"] is True
    sent = [p["token_ids"] for b in server.bodies for p in b["prompts"]]
    assert sent.count(never) == 4
    assert all(": bad_response: 200 without " in line for line in stderr_lines(capsys))


def test_the_servers_own_answer_passes_the_checks_that_find_bad_responses() -> None:
    """The client's checks of a 200 (``decode_extract``, which ``runner.objects_of``
    reads) against hsx's own response schema (service/api/schemas.py): the schema's
    example, as the server serialises it, is accepted; with loss tokens too."""
    import httpx

    from service.api.schemas import ExtractResponse
    from service.client import BadResponseError
    from service.client._base import decode_extract

    example = ExtractResponse.model_json_schema()["examples"][0]
    answer = ExtractResponse.model_validate(example)
    answer.objects[0].num_loss_tokens = 3
    for body in (ExtractResponse.model_validate(example), answer):
        response = httpx.Response(
            200, content=body.model_dump_json(), headers={"Content-Type": "application/json"}
        )
        objects = runner.objects_of(decode_extract(response, 1))
        assert list(objects) == [0]
        assert objects[0]["key"] == example["objects"][0]["key"]
    # The same answer to a request without prompts names a prompt it did not have.
    with pytest.raises(BadResponseError, match=r"objects\[0\]\.index 0 is not a prompt's"):
        decode_extract(httpx.Response(200, content=answer.model_dump_json()), 0)


def test_a_proxy_page_beside_a_good_replica_only_costs_retries(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy, good = servers(html), servers(stored)
    source = write_input(tmp_path / "rows.jsonl", token_rows(30))
    code, _ = dataset_run(
        tmp_path, source, [proxy.url, good.url], "--max-consecutive-errors", "3",
        "--concurrency", "1", "--batch-size", "4",
    )  # fmt: skip
    assert code == 0
    summary = assert_accounted(tmp_path, code, 30)
    assert (summary["ok"], summary["complete"]) == (30, True)
    assert 1 <= len(proxy.bodies) <= 3  # dropped after three in a row at the latest
    sent = [p["custom_id"] for b in good.bodies for p in b["prompts"]]
    assert len(sent) == len(set(sent)) == 30
    assert any("bad_response" in line for line in stderr_lines(capsys))


# ---------------------------------------------------------------- random faults


class Injector:
    """Raises RuntimeError("injected") at random (seeded) from a wrapped function."""

    def __init__(self, seed: int, rate: float) -> None:
        self.rng, self.rate, self.fired = random.Random(seed), rate, 0
        self.lock = threading.Lock()

    def maybe(self) -> None:
        with self.lock:
            fire = self.rng.random() < self.rate
            self.fired += fire
        if fire:
            raise RuntimeError("injected")

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(function):

            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                self.maybe()
                return await function(*args, **kwargs)

            return wrapped_async

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.maybe()
            return function(*args, **kwargs)

        return wrapped


@pytest.mark.parametrize(
    ("seed", "rate", "retries"),
    [(1, 0.1, 30), (2, 0.2, 8), (3, 0.5, 1)],
    ids=["rare-faults", "some-faults", "faults-beyond-retries"],
)
def test_a_run_under_random_faults_ends_with_every_row_decided_or_pending(
    tmp_path: Path,
    servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    seed: int,
    rate: float,
    retries: int,
) -> None:
    """Lone surrogates in the input, a proxy answering 200 with HTML, a replica answering
    garbage now and then, and exceptions injected at random into the workers."""
    answers = random.Random(seed)
    lock = threading.Lock()

    def sometimes_garbage(body: dict[str, Any]) -> Reply:
        with lock:
            roll = answers.random()
        if roll < rate / 4:
            return html(body)
        if roll < rate / 2:
            return 200, {}, {"objects": [{"index": 0, "key": 5}]}
        return stored(body)

    proxy, flaky = servers(html), servers(sometimes_garbage)
    injector = Injector(seed, rate)
    monkeypatch.setattr(runner.Run, "record_object", injector.wrap(runner.Run.record_object))
    monkeypatch.setattr(runner, "objects_of", injector.wrap(runner.objects_of))
    valid = token_rows(60)
    bad = [json.dumps(raw) for raw, _ in SURROGATE_ROWS]
    source = write_input(tmp_path / "rows.jsonl", valid[:20] + bad + valid[20:])

    code, elapsed = dataset_run(
        tmp_path, source, [proxy.url, flaky.url], "--retries", str(retries),
        "--max-consecutive-errors", "6", "--concurrency", "2", "--batch-size", "4",
    )  # fmt: skip
    assert elapsed < LIMIT_S
    assert code in (0, 1)
    assert injector.fired > 0
    assert len(proxy.bodies) >= 1
    summary = assert_accounted(tmp_path, code, 64)
    lines = {line["row"]: line for line in read_manifest(tmp_path)}
    for row in range(20, 24):  # the surrogate rows: failed for good, by input checks
        assert lines[row]["reason"].startswith("malformed: "), lines[row]
        assert lines[row]["retryable"] is False
    stored_ids = {p["custom_id"] for b in flaky.bodies for p in b["prompts"]}
    for line in lines.values():
        if line["status"] == "ok":
            assert line["custom_id"] in stored_ids
        elif line["row"] not in range(20, 24):  # out of retries, with the last cause
            assert line["reason"].startswith(f"gave_up: {retries + 1} attempts, last: ")
            assert any(
                cause in line["reason"]
                for cause in ("internal_error: RuntimeError: injected", "bad_response: ")
            ), line
            assert line["retryable"] is True
    warning = (
        "hsx dataset: warning: a batch failed (internal_error: RuntimeError: injected); "
        "its rows go back on the queue"
    )
    assert warning in stderr_lines(capsys)
    if retries == 1:  # half the attempts fail: some rows must run out of retries
        assert code == 1
        assert summary["reasons"].get("gave_up", 0) > 0
    if code == 0:
        assert (summary["ok"], summary["failed"]) == (60, 4)


# ---------------------------------------------------------------- the supervisor


def test_a_worker_that_dies_stops_the_run(
    tmp_path: Path,
    servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An exception past the batch-level catch (here: in the catch itself) ends the worker;
    the run notices and stops, instead of idling with rows outstanding."""

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    server = servers(stored)
    monkeypatch.setattr(runner.Run, "record_object", broken)
    monkeypatch.setattr(runner.Run, "unexpected", broken)
    source = write_input(tmp_path / "rows.jsonl", token_rows(12))
    code, elapsed = dataset_run(tmp_path, source, [server.url], "--concurrency", "2")
    assert elapsed < LIMIT_S
    assert code == 1
    summary = assert_accounted(tmp_path, code, 12)
    assert summary["stopped"] == "internal error: a worker stopped: RuntimeError: boom"
    assert summary["pending"] == 12
    assert stderr_lines(capsys)[0] == f"hsx dataset: stopping: {summary['stopped']}"


def test_rows_a_bug_loses_stop_the_run(
    tmp_path: Path,
    servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A batch handled without deciding or requeueing its rows (a bug): the run sees
    rows neither queued, in flight nor decided, and stops rather than wait for them."""

    async def forgetful(*args: Any, **kwargs: Any) -> None:
        return None

    server = servers(stored)
    monkeypatch.setattr(runner.Run, "accepted", forgetful)
    source = write_input(tmp_path / "rows.jsonl", token_rows(10))
    code, elapsed = dataset_run(tmp_path, source, [server.url], "--concurrency", "3")
    assert elapsed < LIMIT_S
    assert code == 1
    summary = assert_accounted(tmp_path, code, 10)
    assert summary["stopped"] == (
        "internal error: 10 rows are neither queued, in flight nor decided"
    )
    assert stderr_lines(capsys) == [f"hsx dataset: stopping: {summary['stopped']}"]


def test_an_input_that_breaks_mid_file_stops_the_run(
    tmp_path: Path,
    servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A reader failing past the first rows (a truncated Parquet file, a dropped mount)."""
    iter_rows = runner.iter_rows

    def breaking(source: Any, id_column: str = "custom_id") -> Any:
        for row in iter_rows(source, id_column):
            if row.index == 6:
                raise OSError(5, "Input/output error")
            yield row

    server = servers(stored)
    monkeypatch.setattr(runner, "iter_rows", breaking)
    source = write_input(tmp_path / "rows.jsonl", token_rows(10))
    code, elapsed = dataset_run(tmp_path, source, [server.url])
    assert elapsed < LIMIT_S
    assert code == 1
    summary = assert_accounted(tmp_path, code, 10)
    assert summary["stopped"] == (
        f"cannot read the input {source}: OSError: [Errno 5] Input/output error"
    )
    assert summary["ok"] + summary["pending"] == 10  # rows 0-5 read; those sent are ok
    assert summary["ok"] <= 6
    assert stderr_lines(capsys) == [f"hsx dataset: stopping: {summary['stopped']}"]


def test_a_manifest_that_cannot_be_written_stops_the_run(
    tmp_path: Path,
    servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    append = RunStore.append

    async def full_disk(self: RunStore, log: str, lines: list[str]) -> None:
        if lines:
            raise OSError(28, "No space left on device")
        await append(self, log, lines)

    server = servers(stored)
    monkeypatch.setattr(RunStore, "append", full_disk)
    source = write_input(tmp_path / "rows.jsonl", token_rows(10))
    code, elapsed = dataset_run(tmp_path, source, [server.url])
    assert elapsed < LIMIT_S
    assert code == 1
    summary = read_summary(tmp_path)
    assert summary["stopped"] == (
        f"cannot write the manifest to {tmp_path / 'out'}: "
        "OSError: [Errno 28] No space left on device"
    )
    assert summary["complete"] is False
    assert stderr_lines(capsys) == [f"hsx dataset: stopping: {summary['stopped']}"]
