"""Input readers and row normalisation, without a server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.dataset.inputs import (
    InputError,
    content_id,
    iter_rows,
    normalise,
    open_source,
    shard_of,
)
from tests.dataset.synth import make

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
]
ROWS: list[dict[str, Any]] = [
    {"messages": CHAT, "custom_id": "chat-1"},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"token_ids": [1, 2, 3]},
    {"text": "plain text"},
]


def write_all(tmp_path: Path, rows: list[Any]) -> dict[str, Path]:
    """The same rows as JSONL, JSON, Parquet and a save_to_disk directory."""
    from datasets import Dataset

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    as_json = tmp_path / "rows.json"
    as_json.write_text(json.dumps(rows))
    parquet = tmp_path / "rows.parquet"
    columns = sorted({key for row in rows for key in row})
    # Column-wise, so one schema covers every row (from_list infers from the first).
    dataset = Dataset.from_dict({c: [row.get(c) for row in rows] for c in columns})
    dataset.to_parquet(str(parquet))
    arrow = tmp_path / "rows-arrow"
    dataset.save_to_disk(str(arrow))
    return {"jsonl": jsonl, "json": as_json, "parquet": parquet, "arrow": arrow}


def test_every_format_gives_the_same_prompts(tmp_path: Path) -> None:
    # Columnar formats fill absent columns with nulls: a row keeps its one prompt column.
    rows = [dict(r) for r in ROWS]
    expected = [
        {"messages": CHAT},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"token_ids": [1, 2, 3]},
        {"text": "plain text"},
    ]
    for kind, path in write_all(tmp_path, rows).items():
        source = open_source(path)
        assert source.format == kind
        assert source.count() == 4
        got = list(iter_rows(source))
        assert [r.prompt for r in got] == expected, kind
        assert got[0].custom_id == "chat-1"
        assert all(r.error is None for r in got)
        # Ids from content are the same whichever file holds the row (nulls aside).
        assert got[2].custom_id.startswith("row-")


def test_sharegpt_roles_normalise_as_speculators_does() -> None:
    preprocessing = pytest.importorskip("speculators.data_generation.preprocessing")
    turns = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a"},
        {"from": "chatgpt", "value": "b"},  # an unknown speaker: the assistant, as there
        {"from": "user", "value": "q2"},
        {"from": "assistant", "value": "a2"},
    ]
    row = normalise(0, {"conversations": turns})
    assert row.prompt == {"messages": preprocessing._normalize_conversation(turns)}


def test_content_ids_are_stable_and_custom_ids_win() -> None:
    row = {"text": "x", "meta": {"b": 1, "a": 2}}
    reordered = {"meta": {"a": 2, "b": 1}, "text": "x"}
    assert normalise(0, row).custom_id == normalise(9, reordered).custom_id == content_id(row)
    assert normalise(0, {"text": "y"}).custom_id != content_id(row)
    assert normalise(0, {"text": "x", "id": 42}, id_column="id").custom_id == "42"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"messages": []}, "messages must be a non-empty list of turns"),
        ({"messages": [{"content": "x"}]}, "messages[0] has no role"),
        ({"conversations": [{"from": "human", "value": 3}]}, "content must be text"),
        ({"token_ids": [1, -2]}, "non-negative integers"),
        ({"text": ""}, "text must be a non-empty string"),
        ({"other": 1}, "no prompt column"),
        ({"text": "a", "token_ids": [1]}, "more than one prompt column: token_ids, text"),
        ({"text": "a", "custom_id": "x" * 300}, "custom_id must be 1-256 characters"),
        ([1, 2], "a row must be an object, not list"),
    ],
)
def test_malformed_rows_say_why(raw: Any, reason: str) -> None:
    row = normalise(5, raw)
    assert row.prompt is None
    assert row.error is not None
    assert row.error.startswith("malformed: ")
    assert reason in row.error


def test_openai_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    row = normalise(0, {"messages": [{"role": "user", "content": parts}]})
    assert row.prompt == {"messages": [{"role": "user", "content": "ab"}]}
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert "content must be text" in str(
        normalise(0, {"messages": [{"role": "user", "content": image}]}).error
    )


def test_four_shards_cover_every_row_exactly_once(tmp_path: Path) -> None:
    data = make(1000, seed=1)
    rows = list(iter_rows(open_source(data.write_jsonl(tmp_path / "d.jsonl"))))
    shards = [{r.index for r in rows if shard_of(r.custom_id, 4) == i} for i in range(4)]
    assert sum(len(s) for s in shards) == 1000
    assert set().union(*shards) == set(range(1000))
    assert all(150 < len(s) < 350 for s in shards)  # a hash spreads them


def test_a_torn_jsonl_line_is_a_malformed_row_not_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b\n\n{"text": "c"}\n')
    rows = list(iter_rows(open_source(path)))
    assert [r.prompt for r in rows] == [{"text": "a"}, None, {"text": "c"}]
    assert "not JSON" in str(rows[1].error)


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (lambda p: p / "missing.jsonl", "missing.jsonl: no such file"),
        (lambda p: _write(p / "x.csv", "a,b\n"), "unknown format '.csv'"),
        (lambda p: _write(p / "x.jsonl", "\x00\x01 binary\n"), "the first line is not JSON"),
        (lambda p: _write(p / "x.json", "{not json"), "not JSON"),
        (lambda p: _write(p / "x.json", '{"a": 1}'), "expected a JSON list of rows"),
        (lambda p: _write(p / "x.parquet", "PAR1 not really"), "cannot read it as parquet"),
        (lambda p: _mkdir(p / "plain-dir"), "not one saved with datasets' save_to_disk"),
        (lambda p: _write(p / "x.jsonl", ""), "no rows"),
        (
            lambda p: _write(p / "x.jsonl", '{"prompt": "a", "answer": "b"}\n'),
            "no prompt column; found ['answer', 'prompt'], expected one of messages, "
            "conversations, token_ids, text",
        ),
    ],
)
def test_unusable_inputs_are_refused_with_one_sentence(
    tmp_path: Path, make_input: Any, message: str
) -> None:
    with pytest.raises(InputError, match="^.*" + _escape(message)):
        open_source(make_input(tmp_path))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def test_batch_api_lines_read_alike_from_every_format(tmp_path: Path) -> None:
    # Columnar formats give every body every field (nulls): a null is the field's default.
    rows = [
        {"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": CHAT[:2], "max_tokens": 1, **({"seed": i} if i else {})}}
        for i in range(3)
    ]  # fmt: skip
    for kind, path in write_all(tmp_path, rows).items():
        got = list(iter_rows(open_source(path)))
        assert [r.custom_id for r in got] == ["b0", "b1", "b2"], kind
        assert all(r.prompt == {"messages": CHAT[:2]} for r in got), (kind, got[0].error)


# ---------------------------------------------------------------- hostile lines (issue 58)

#: A line nested 100,000 deep: valid JSON, beyond what Python's reader can recurse into.
DEEP = '{"custom_id": "deep", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
TOO_DEEP = "malformed: nested too deep to read (Python's recursion limit)"


def batch_line(custom_id: str, role: Any) -> str:
    body = {"messages": [{"role": role, "content": "hi"}]}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def test_a_line_too_deep_to_read_is_its_row_s_failure_even_first(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    good = [json.dumps({"text": f"row {i}"}) for i in range(3)]
    path.write_text("\n".join([DEEP, good[0], DEEP.replace("deep", "deep-2"), *good[1:]]) + "\n")
    rows = list(iter_rows(open_source(path)))  # not refused for its first line
    assert [r.error for r in rows] == [TOO_DEEP, None, TOO_DEEP, None, None]
    assert [r.prompt for r in rows[1::2]] + [rows[4].prompt] == [
        {"text": "row 0"},
        {"text": "row 1"},
        {"text": "row 2"},
    ]
    assert rows[0].custom_id != rows[2].custom_id  # two rows, not one row twice


def test_batch_lines_with_a_list_or_dict_role_fail_alone(tmp_path: Path) -> None:
    lines = [batch_line("good-0", "user"), batch_line("list", ["user"])]
    lines += [batch_line("dict", {"role": "user"}), DEEP, batch_line("good-1", "user")]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = list(iter_rows(open_source(path)))
    assert [r.custom_id for r in rows[:3]] == ["good-0", "list", "dict"]
    assert [r.prompt for r in (rows[0], rows[4])] == [
        {"messages": [{"role": "user", "content": "hi"}]}
    ] * 2
    roles = "['assistant', 'system', 'tool', 'user']"
    assert rows[1].error == (
        f"malformed: row 1 (custom_id 'list'): body.messages[0].role ['user']: one of {roles}"
    )
    assert rows[2].error == (
        "malformed: row 2 (custom_id 'dict'): body.messages[0].role {'role': 'user'}: "
        f"one of {roles}"
    )
    assert rows[3].error == TOO_DEEP


def test_whatever_normalising_raises_fails_that_row_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader bug on one row (any exception) is that row's reason, not the input's."""
    from service.dataset import inputs

    normalise = inputs.normalise

    def buggy(index: int, raw: Any, *args: Any) -> Any:
        if raw.get("text") == "b":
            raise TypeError("unhashable type: 'list'")
        return normalise(index, raw, *args)

    monkeypatch.setattr(inputs, "normalise", buggy)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b", "custom_id": "b-1"}\n{"text": "c"}\n')
    rows = list(iter_rows(open_source(path)))
    assert [r.prompt for r in rows] == [{"text": "a"}, None, {"text": "c"}]
    assert (rows[1].custom_id, rows[1].error) == (
        "b-1",
        "malformed: cannot be read: TypeError: unhashable type: 'list'",
    )
