"""A hostile or broken server (issue 58, L5): an answer naming a prompt twice or a
prompt it was not sent, keys that are not hsx keys of the caller's namespace, a body
trickled a byte a second, a body larger than any hsx answer. No such row is ``ok``:
each ends ``failed`` with the reason, and the run ends within a bound.

Only a stand-in (``tests/dataset/standins.py``) answers like this on demand."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from service.client.models import ExtractResponse
from service.dataset.answers import AnswerCheck, answer_cap, key_root
from tests.dataset.cli_runs import dataset_run, read_manifest, write_input
from tests.dataset.standins import Flood, Reply, Trickled, stored

#: One attempt per row, so a refused answer is the row's failure at once.
ONCE = ("--retries", "0", "--batch-size", "1", "--concurrency", "1")


def rows(*custom_ids: str) -> list[str]:
    return [
        json.dumps({"token_ids": [3, 4, 5 + i], "custom_id": c}) for i, c in enumerate(custom_ids)
    ]


def gave_up(url: str, cause: str) -> str:
    return f"gave_up: 1 attempts, last: {url}: {cause}"


def by_id(namespace: str, custom_id: str) -> str:
    digest = hashlib.sha256(custom_id.encode()).hexdigest()
    return f"hsx/{namespace}/by-id/{digest[:2]}/{digest}.safetensors"


TWICE = "bad_response: 200 answering prompt 0 twice"
NOT_SENT = "bad_response: objects[0].index 1 is not a prompt's"


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda objects: [*objects, dict(objects[0])], TWICE),
        (lambda objects: [{**objects[0], "index": 1}], NOT_SENT),
    ],
    ids=["twice", "not-sent"],
)
def test_an_answer_that_is_not_exactly_the_batch_s_prompts_is_no_row_ok(
    tmp_path: Path, servers: Any, change: Any, cause: str
) -> None:
    def answer(body: dict[str, Any]) -> Reply:
        status, headers, reply = stored(body)
        return status, headers, {**reply, "objects": change(reply["objects"])}

    server = servers(answer)
    source = write_input(tmp_path / "rows.jsonl", rows("a", "b", "c"))
    code, _ = dataset_run(tmp_path, source, [server.url], *ONCE)
    assert code == 1  # retryable failures: the next run sends them again
    records = read_manifest(tmp_path)
    assert [(r["status"], r["reason"]) for r in records] == [
        ("failed", gave_up(server.url, cause))
    ] * 3


def test_keys_outside_the_caller_s_namespace_are_no_row_ok(tmp_path: Path, servers: Any) -> None:
    """The first answer's keys name the run's namespace (hsx/t); a key with ``..`` or
    another namespace's key after it is refused, the good rows around them are ok."""
    keys = {"evil-dots": "../../../../etc/passwd", "evil-ns": by_id("other-team", "evil-ns")}

    def answer(body: dict[str, Any]) -> Reply:
        status, headers, reply = stored(body)
        for obj, prompt in zip(reply["objects"], body["prompts"], strict=True):
            obj["key"] = keys.get(prompt["custom_id"], obj["key"])
        return status, headers, reply

    server = servers(answer)
    source = write_input(tmp_path / "rows.jsonl", rows("good-0", "evil-dots", "good-1", "evil-ns"))
    code, _ = dataset_run(tmp_path, source, [server.url], *ONCE)
    assert code == 1
    records = {r["custom_id"]: r for r in read_manifest(tmp_path)}
    assert [records[c]["status"] for c in ("good-0", "good-1")] == ["ok", "ok"]
    assert records["good-0"]["key"] == by_id("t", "good-0")
    assert records["evil-dots"]["status"] == records["evil-ns"]["status"] == "failed"
    assert records["evil-dots"]["reason"] == gave_up(
        server.url,
        "bad_response: 200 whose objects[0].key '../../../../etc/passwd' is not an hsx "
        "object key: key segment '..' is not allowed",
    )
    assert records["evil-ns"]["reason"] == gave_up(
        server.url,
        f"bad_response: 200 whose objects[0].key {keys['evil-ns']!r} is outside the run's hsx/t/",
    )
    assert "key" not in records["evil-dots"]


def test_a_body_trickled_a_byte_a_second_ends_at_the_request_timeout(
    tmp_path: Path, servers: Any
) -> None:
    """Every read is in time (a byte a second under a 2 s read timeout); the whole
    answer (some 400 bytes: 400 s) is not: the run ends at the 2 s deadline."""

    def trickle(body: dict[str, Any]) -> Reply:
        return 200, {}, Trickled(json.dumps(stored(body)[2]).encode(), every_s=1.0)

    server = servers(trickle)
    source = write_input(tmp_path / "rows.jsonl", rows("slow"))
    code, elapsed = dataset_run(tmp_path, source, [server.url], "--request-timeout", "2", *ONCE)
    assert code == 1
    (record,) = read_manifest(tmp_path)
    assert record["status"] == "failed"
    assert record["reason"] == gave_up(
        server.url, "timeout: no whole answer within --request-timeout 2 s"
    )
    assert 2.0 <= elapsed < 2.0 + 10.0
    assert server.streamed <= 4  # the answer was cut at 2 s, not read to its end


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "until-close"])
def test_a_body_over_the_cap_is_refused_without_reading_it(
    tmp_path: Path, servers: Any, declared: bool
) -> None:
    """A 300 MB answer to one prompt (hsx's is ~1 kB): refused by its Content-Length
    before a byte is read, or once the cap is passed when it has none."""
    size = 300 * 10**6
    server = servers(lambda body: (200, {}, Flood(size, declared)))
    source = write_input(tmp_path / "rows.jsonl", rows("flood"))
    code, _ = dataset_run(tmp_path, source, [server.url], *ONCE)
    assert code == 1
    (record,) = read_manifest(tmp_path)
    cap = answer_cap(1)
    cause = (
        f"answer of {size} bytes (Content-Length) is over the cap of {cap} bytes for this request"
        if declared
        else f"answer over the cap of {cap} bytes for this request (stopped reading)"
    )
    assert record["reason"] == gave_up(server.url, f"AnswerTooLargeError: {cause}")
    assert server.streamed < 32 * 2**20  # the kernel's buffers at most, of 300 MB


def extract_answer(*keys: str) -> ExtractResponse:
    objects = [
        {"index": i, "key": key, "uri": "", "num_tokens": 1, "shape": [1, 2, 4], "bytes": 1,
         "sha256": "0" * 64}
        for i, key in enumerate(keys)
    ]  # fmt: skip
    return ExtractResponse.model_validate(
        {"id": "x", "model": "tiny", "layer_ids": [1, 2], "dtype": "float32", "hidden_size": 4,
         "objects": objects, "codecs": ["raw"], "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    )  # fmt: skip


def test_the_answer_check_takes_hsx_keys_of_one_namespace_only() -> None:
    a, b = by_id("team-a", "a"), by_id("team-a", "b")
    dated = "hsx/team-a/2026/11/21/3f0c.safetensors"
    assert {key_root(k) for k in (a, b, dated)} == {"hsx/team-a"}
    assert key_root("team-a/by-id/ab/ab12.safetensors") == "team-a"  # no key prefix
    for bad, why in [
        ("/etc/passwd", "key segment '' is not allowed"),
        ("hsx/team-a/by-id/../x.safetensors", "key segment '..' is not allowed"),
        ("hsx/team-a/by-id/ab/x.json", "not .../NAMESPACE/by-id/HH/ID.safetensors"),
        ("hsx/Team A/by-id/ab/x.safetensors", "key segment 'Team A' is not allowed"),
        ("hsx/TEAM/by-id/ab/x.safetensors", "namespace 'TEAM' must be"),
    ]:
        with pytest.raises(ValueError, match=re.escape(why)):
            key_root(bad)
    check = AnswerCheck()
    assert list(check.objects(extract_answer(a, b))) == [0, 1]
    assert check.root == "hsx/team-a"
    with pytest.raises(Exception, match="one key for prompts 0 and 1"):
        check.objects(extract_answer(a, a))
    with pytest.raises(Exception, match=r"objects\[1\] is in hsx/team-b/, not hsx/team-a/"):
        AnswerCheck().objects(extract_answer(a, by_id("team-b", "b")))
    with pytest.raises(Exception, match="outside the run's hsx/team-a/"):
        check.objects(extract_answer(by_id("team-b", "c")))
