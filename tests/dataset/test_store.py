"""The contract of ``RunStore``, the same on a directory and on S3 (moto): documents
replaced whole, logs appended and read back in order across sessions, shards as
children, nothing read from an output that does not exist yet."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from service.config import S3StorageSettings
from service.dataset.store import RunStore

Open = Callable[[], RunStore]
T = TypeVar("T")


@pytest.fixture(params=["local", "s3"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Open]:
    """A factory of stores on one new output: each call is another session."""
    if request.param == "local":
        url, s3 = str(tmp_path / "out"), None
    else:
        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("s3_endpoint")
        url = f"s3://{bucket}/runs/{uuid.uuid4().hex[:6]}"
        s3 = S3StorageSettings(endpoint_url=endpoint, region="us-east-1", max_attempts=2)
    opened: list[RunStore] = []

    def make() -> RunStore:
        opened.append(RunStore(url, s3))
        return opened[-1]

    yield make
    for store in opened:
        asyncio.run(store.close())


def run(work: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(work)


def test_a_new_output_holds_nothing(opener: Open) -> None:
    store = opener()
    assert run(store.read("job.json")) is None
    assert run(store.lines("manifest")) == []
    assert run(store.children()) == []


def test_documents_are_replaced_whole(opener: Open) -> None:
    store = opener()
    run(store.write("job.json", b'{"a": 1}'))
    run(store.write("job.json", b'{"a": 2}'))
    assert run(opener().read("job.json")) == b'{"a": 2}'
    assert run(store.read("summary.json")) is None


def test_logs_read_back_in_order_across_sessions(opener: Open) -> None:
    first = opener()
    run(first.append("manifest", ["1", "2"]))
    run(first.append("manifest", []))  # nothing to write: no part, no line
    run(first.append("errors", ["e"]))
    second = opener()  # a resumed run, later
    run(second.append("manifest", ["3"]))
    run(first.append("manifest", ["4"]))
    assert run(opener().lines("manifest")) == ["1", "2", "3", "4"]
    assert run(second.lines("errors")) == ["e"]


def test_shards_are_children_with_a_job(opener: Open) -> None:
    root = opener()
    for name in ("shard-00001-of-00002", "shard-00000-of-00002"):
        shard = root.child(name)
        run(shard.write("job.json", b"{}"))
        run(shard.append("manifest", [name]))
    run(root.child("scratch").write("notes.json", b"{}"))  # no job.json: not a shard
    assert run(opener().children()) == ["shard-00000-of-00002", "shard-00001-of-00002"]
    assert run(root.child("shard-00001-of-00002").lines("manifest")) == ["shard-00001-of-00002"]
    assert root.child("x").url == f"{root.url}/x"


def test_a_local_output_is_made_by_the_first_write_only(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "out"))
    assert run(store.read("job.json")) is None
    assert not (tmp_path / "out").exists()
    run(store.write("job.json", b"{}"))
    assert (tmp_path / "out" / "job.json").read_bytes() == b"{}"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["job.json"]  # no temp file left
    run(store.close())
