"""OpenAI Batch API lines as dataset rows (``service.dataset.batch_api``), and
``hsx dataset export --format openai-batch``, against scripted stand-ins."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.dataset import RunOptions, run_dataset
from service.dataset.batch_api import BATCH_ONLY, REFUSED, RunRequest
from service.dataset.inputs import iter_rows, normalise, open_source
from tests.dataset.standins import MODEL, Reply

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
DONE = [*CHAT, {"role": "assistant", "content": "hello"}]
#: (Batch line, the native row it must equal).
PAIRS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": CHAT, "max_tokens": 1, "seed": 3, "top_p": 0.5}},
        {"custom_id": "c1", "messages": CHAT},
    ),
    (
        {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": DONE, "add_generation_prompt": False, "temperature": 0}},
        {"custom_id": "c2", "messages": DONE},
    ),
    (
        {"custom_id": "c3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}]}},
        {"custom_id": "c3", "messages": [{"role": "user", "content": "a\nb"}]},
    ),
    (
        {"custom_id": "t1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "plain text", "max_tokens": 1}},
        {"custom_id": "t1", "text": "plain text"},
    ),
    (
        {"custom_id": "t2", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ["one text"], "max_tokens": 1, "stream": False}},
        {"custom_id": "t2", "text": "one text"},
    ),
    (
        {"custom_id": "i1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7], "max_tokens": 1}},
        {"custom_id": "i1", "token_ids": [5, 6, 7]},
    ),
    (
        {"custom_id": "i2", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [[8, 9]], "max_tokens": 1, "return_token_ids": True}},
        {"custom_id": "i2", "token_ids": [8, 9]},
    ),
]  # fmt: skip


def answer(body: dict[str, Any]) -> Reply:
    """hsx's answer for prompts of any kind (the stand-in's ``stored`` takes token ids)."""
    objects = []
    for index, prompt in enumerate(body["prompts"]):
        size = len(prompt.get("token_ids") or json.dumps(prompt).split())
        digest = hashlib.sha256(prompt["custom_id"].encode()).hexdigest()
        objects.append(
            {"index": index, "key": f"hsx/t/by-id/{digest[:2]}/{digest}.safetensors",
             "uri": "file:///x", "num_tokens": size, "shape": [size, 2, 4],
             "bytes": 100 + size, "sha256": digest, "status": "created"}
        )  # fmt: skip
    served = {name: MODEL[name] for name in ("layer_ids", "dtype", "hidden_size", "codecs")}
    tokens = sum(o["num_tokens"] for o in objects)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    answer = {"id": "ext", "model": MODEL["id"], **served, "objects": objects}
    return 200, {}, {**answer, "usage": usage}


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def received(server: Any) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each prompt the stand-in got, by custom_id, and every body's other fields."""
    prompts = {p["custom_id"]: p for b in server.bodies for p in b["prompts"]}
    others = [{k: v for k, v in b.items() if k != "prompts"} for b in server.bodies]
    return prompts, others


def test_batch_lines_send_what_the_native_rows_send(tmp_path: Path, servers: Any) -> None:
    loss = "none"  # the run's options reach the lines once the session sets Source.expect
    sent = {}
    for kind, rows in (("batch", [b for b, _ in PAIRS]), ("native", [n for _, n in PAIRS])):
        server = servers(answer)
        options = RunOptions(
            input=str(write(tmp_path / f"{kind}.jsonl", rows)),
            endpoints=[server.url],
            output=str(tmp_path / kind),
            progress=False,
            loss=loss,  # type: ignore[arg-type]
        )
        summary = run_dataset(options)
        assert (summary.ok, summary.failed, summary.complete) == (len(PAIRS), 0, True), kind
        sent[kind] = received(server)
    batch_prompts, batch_others = sent["batch"]
    native_prompts, native_others = sent["native"]
    assert batch_prompts == native_prompts
    assert set(batch_prompts) == {b["custom_id"] for b, _ in PAIRS}
    assert {json.dumps(o, sort_keys=True) for o in batch_others} == {
        json.dumps(o, sort_keys=True) for o in native_others
    }
    assert all(o["loss"] == loss and o["max_tokens"] == 1 for o in batch_others)


def line(body: dict[str, Any], url: str = "/v1/chat/completions", **top: Any) -> dict[str, Any]:
    return {"custom_id": "req-7", "method": "POST", "url": url, "body": body, **top}


MSG = {"messages": CHAT}


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (line(MSG, url="/v1/embeddings"), ["url '/v1/embeddings'"]),
        (line(MSG, method="GET"), ["method 'GET'"]),
        (line(MSG, extra=1), ["['extra']"]),
        ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, ["custom_id"]),
        (line([1]), ["body must be an object"]),
        (line({"messages": []}), ["body.messages"]),
        (line({"messages": [{"role": "developer", "content": "x"}]}), ["messages[0].role"]),
        (line({"messages": [{"role": "user", "content": "x", "name": "bob"}]}), ["['name']"]),
        (line({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
         ["messages[0].content"]),
        (line({**MSG, "tools": [{"type": "function"}]}), ["body.tools"]),
        (line({**MSG, "chat_template": "{{ x }}"}), ["body.chat_template"]),
        (line({**MSG, "chat_template_kwargs": {"enable_thinking": False}}),
         ["body.chat_template_kwargs"]),
        (line({**MSG, "add_generation_prompt": False}), ["body.add_generation_prompt"]),
        (line({"messages": DONE}), ["body.add_generation_prompt"]),
        (line({"messages": DONE, "add_generation_prompt": False, "continue_final_message": True}),
         ["body.continue_final_message"]),
        (line({**MSG, "temperature": 0.7}), ["body.temperature", "greedily"]),
        (line({**MSG, "n": 2}), ["body.n"]),
        (line({**MSG, "stream": True}), ["body.stream"]),
        (line({**MSG, "logprobs": True}), ["body.logprobs"]),
        (line({**MSG, "max_tokens": 16}), ["body.max_tokens 16", "--max-tokens 1"]),
        (line({**MSG, "max_completion_tokens": 4}), ["body.max_completion_tokens 4"]),
        (line({**MSG, "codec": "fp8"}), ["body.codec 'fp8'", "--codec"]),
        (line({**MSG, "layers": [1]}), ["body.layers [1]", "--layers"]),
        (line({**MSG, "loss": "assistant"}), ["body.loss 'assistant'", "--loss none"]),
        (line({**MSG, "include_output_tokens": True}), ["body.include_output_tokens"]),
        (line({**MSG, "metadata": {"a": "b"}}), ["body.metadata"]),
        (line({**MSG, "tokens": "last"}), ["body.tokens"]),
        (line({**MSG, "return": "inline"}), ["body.return"]),
        (line({**MSG, "custom_id": "other"}), ["body.custom_id 'other'"]),
        (line({**MSG, "ttl_s": 5}), ["body.ttl_s", "unknown"]),
        (line({"prompt": ["a", "b"]}, url="/v1/completions"), ["body.prompt holds 2"]),
        (line({"prompt": ""}, url="/v1/completions"), ["body.prompt"]),
        (line({"prompt": "x", "suffix": "y"}, url="/v1/completions"), ["body.suffix"]),
        (line({"prompt": "x", "echo": True}, url="/v1/completions"), ["body.echo"]),
        (line({"prompt": "x", "add_special_tokens": False}, url="/v1/completions"),
         ["body.add_special_tokens"]),
        (line({"prompt": "x", "loss": "assistant"}, url="/v1/completions"),
         ["needs a chat request"]),
        (line({"prompt": "x", "messages": CHAT}, url="/v1/completions"), ["body.messages"]),
        (line({"messages": [{"role": "user", "content": "\ud800"}]}),
         ["body.messages[0].content", "U+D800"]),
    ],
)  # fmt: skip
def test_a_line_that_cannot_be_read_as_its_route_reads_it_is_refused_naming_it(
    raw: dict[str, Any], names: list[str]
) -> None:
    row = normalise(7, raw)
    assert row.prompt is None
    assert row.error is not None
    assert row.error.startswith("malformed: row 7")
    if "custom_id" in raw:
        assert "(custom_id 'req-7')" in row.error
        assert row.custom_id == "req-7"
    for name in names:
        assert name in row.error, (name, row.error)


def test_the_run_s_options_are_what_lines_must_agree_with() -> None:
    run = RunOptions(input="x", endpoints=["http://h"], output="o", max_tokens=8, loss="all",
                     codec="fp8", layers=[2]).run_request(model="tiny")  # fmt: skip
    agreeing = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "loss": "all",
                "codec": "fp8", "layers": [2], "custom_id": "req-7"}  # fmt: skip
    assert normalise(0, line(agreeing), run=run).prompt == {"messages": CHAT}
    # Absent fields take the run's; the route's default max_tokens matters only when the
    # generated tokens are stored.
    assert normalise(0, line({"messages": CHAT, "loss": "all", "codec": "fp8", "layers": [2]}),
                     run=run).error is None  # fmt: skip
    wrong_model = normalise(0, line({**agreeing, "model": "other"}), run=run).error
    assert wrong_model is not None
    assert "body.model 'other'" in wrong_model
    outputs = RunRequest(max_tokens=4, include_output_tokens=True)
    ids = line({"prompt": [1, 2], "include_output_tokens": True}, url="/v1/completions")
    error = normalise(0, ids, run=outputs).error
    assert error is not None
    assert "generates 16" in error
    given = {**ids, "body": {**ids["body"], "max_tokens": 4}}
    assert normalise(0, given, run=outputs).prompt == {"token_ids": [1, 2]}


def test_a_source_reads_batch_lines_with_the_run_s_expectations(tmp_path: Path) -> None:
    path = write(tmp_path / "b.jsonl", [line({**MSG, "max_tokens": 8})])
    source = open_source(path)  # a file of Batch lines has no prompt column: accepted
    assert next(iter_rows(source)).error is not None  # default: --max-tokens 1
    source.expect = RunRequest(max_tokens=8)
    assert next(iter_rows(source)).prompt == {"messages": CHAT}


def test_refusals_mirror_the_openai_routes() -> None:
    protocol = pytest.importorskip("service.api.openai_protocol")
    assert set(REFUSED) - BATCH_ONLY == {r.field for r in protocol.REFUSALS}
    assert not BATCH_ONLY & {r.field for r in protocol.REFUSALS}
    for refusal in protocol.REFUSALS:
        neutral, reason = REFUSED[refusal.field]
        assert reason.startswith(refusal.reason[:20]), refusal.field
        for value in (None, 0, 1, False, True, [], {}, "", "x", 0.5):
            assert neutral(value) == refusal.neutral(value), (refusal.field, value)
    text, schema = {"type": "text"}, {"type": "json_schema"}
    assert REFUSED["response_format"][0](text)
    assert not REFUSED["response_format"][0](schema)


# ---------------------------------------------------------------- export


def run_batch(tmp_path: Path, servers: Any) -> tuple[Any, Path, list[dict[str, Any]]]:
    rows = [b for b, _ in PAIRS]
    rows.append(line({**MSG, "temperature": 1.0}))  # refused: req-7
    rows.append({**PAIRS[0][0]})  # a duplicate custom_id: one output line
    server = servers(answer)
    out = tmp_path / "out"
    options = RunOptions(input=str(write(tmp_path / "in.jsonl", rows)), endpoints=[server.url],
                         output=str(out), progress=False)  # fmt: skip
    summary = run_dataset(options)
    assert (summary.ok, summary.failed, summary.skipped) == (len(PAIRS), 1, 1)
    records = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    return server, out, records


@pytest.mark.parametrize("storage", [None, "s3://bucket/objects"])
def test_export_writes_one_batch_output_line_per_custom_id(
    tmp_path: Path, servers: Any, storage: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    server, out, records = run_batch(tmp_path, servers)
    dest = tmp_path / "results.jsonl"
    flags = ["--storage-url", storage] if storage else []
    code = main(["dataset", "export", str(out), str(dest), "--format", "openai-batch",
                 "--endpoint", server.url, *flags])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in dest.read_text().splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert ids == [b["custom_id"] for b, _ in PAIRS] + ["req-7"]  # input order, no duplicate
    ok = {r["custom_id"]: r for r in records if r["status"] == "ok"}
    for got in lines:
        assert set(got) == {"id", "custom_id", "response", "error"}
        assert isinstance(got["id"], str)
        assert got["id"]
        if got["custom_id"] == "req-7":
            assert got["response"] is None
            assert got["error"]["code"] == "malformed"
            assert "body.temperature" in got["error"]["message"]
            continue
        assert got["error"] is None
        response = got["response"]
        assert set(response) == {"status_code", "request_id", "body"}
        assert response["status_code"] == 200
        assert response["request_id"]
        params = response["body"]["kv_transfer_params"]
        record = ok[got["custom_id"]]
        assert response["body"]["model"] == MODEL["id"]
        for name in ("key", "num_tokens", "num_loss_tokens", "bytes", "sha256"):
            assert params[name] == record.get(name), name
        assert params["handle"] == record["key"]
        assert params["codec"] == "raw"
        if storage is None:
            assert params["uri"] == f"{server.url}/objects/{record['key']}"
            assert "hidden_states_path" not in params
        else:
            assert params["uri"] == f"{storage}/{record['key']}"
            assert params["hidden_states_path"] == params["uri"]


def test_export_refuses_an_existing_target(tmp_path: Path, servers: Any, capsys: Any) -> None:
    server, out, _ = run_batch(tmp_path, servers)
    dest = tmp_path / "results.jsonl"
    dest.write_text("keep\n")
    code = main(["dataset", "export", str(out), str(dest), "--format", "openai-batch",
                 "--endpoint", server.url])  # fmt: skip
    assert code == 2
    assert "exists" in capsys.readouterr().err
    assert dest.read_text() == "keep\n"


# ---------------------------------------------------------------- hostile lines (issue 58)


def test_hostile_lines_fail_alone_and_a_resume_finishes(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ten good lines and three no reader can take (a list role, a dict role, a line
    nested 100,000 deep): exit 0, the ten ok, the three malformed; a resume sends
    nothing again (the stand-in's run; tests/dataset/test_dataset_e2e.py runs it on
    real servers)."""
    good = [line({"messages": [{"role": "user", "content": f"hi {i}"}]}) for i in range(10)]
    for number, row in enumerate(good):
        row["custom_id"] = f"good-{number}"
    rows = [json.dumps(r) for r in good]
    rows[3:3] = [json.dumps(line({"messages": [{"role": ["user"], "content": "x"}]}))]
    rows[6:6] = [json.dumps({**line({"messages": [{"role": {"r": 1}, "content": "x"}]}),
                             "custom_id": "dict-role"})]  # fmt: skip
    deep = "[" * 100_000 + "]" * 100_000
    rows[9:9] = [json.dumps(line({"messages": "DEEP"})).replace('"DEEP"', deep)]
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(rows) + "\n")
    server = servers(answer)
    argv = ["dataset", "run", str(source), "--endpoint", server.url,
            "--output", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["ok"], summary["failed"], summary["pending"]) == (10, 3, 0)
    records = [
        json.loads(x) for x in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()
    ]
    failed = {r["row"]: r["reason"] for r in records if r["status"] == "failed"}
    assert failed[3].startswith(
        "malformed: row 3 (custom_id 'req-7'): body.messages[0].role ['user']"
    )
    assert failed[6].startswith(
        "malformed: row 6 (custom_id 'dict-role'): body.messages[0].role {'r': 1}"
    )
    assert failed[9] == "malformed: nested too deep to read (Python's recursion limit)"
    assert sorted(p["custom_id"] for b in server.bodies for p in b["prompts"]) == sorted(
        f"good-{i}" for i in range(10)
    )
    sent = server.prompts()
    assert main(argv) == 0  # the resume: every row decided, nothing sent again
    assert server.prompts() == sent
