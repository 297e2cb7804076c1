"""Where a run keeps its state: a local directory or an S3 prefix.

Two operations matter: whole documents (``job.json``, ``summary.json``), written
atomically, and append-only logs (the manifest, ``errors.jsonl``). On local disk a log
is one file, appended and fsynced; a line torn by a kill is cut off before the next
append. S3 has no append, so each flush of a log is a new object under
``<name>/<session>-<seq>.jsonl``; reading a log concatenates them in key order.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Protocol


class OutputError(Exception):
    """A run's output (or an export's target) cannot be written."""


def write_problem(path: Path) -> str | None:
    """Why a directory cannot be made or written at ``path`` (None: it can, as far as
    can be told without writing): a file in the way, or no write permission on the
    nearest existing directory."""
    here = path
    while not here.exists() and here.parent != here:
        here = here.parent
    if here.exists() and not here.is_dir():
        return "is a file, not a directory" if here == path else f"{here} is a file"
    if not os.access(here, os.W_OK | os.X_OK):
        return "is not writable" if here == path else f"{here} is not writable"
    return None


class StateStore(Protocol):
    """The run's output location."""

    url: str
    #: Seconds between flushes of a log (each S3 flush is a new object).
    flush_interval_s: float

    def exists(self, name: str) -> bool:
        """Whether the document ``name`` exists."""

    def read(self, name: str) -> bytes | None:
        """The document ``name``, or None."""

    def write(self, name: str, data: bytes) -> None:
        """Replace the document ``name`` atomically."""

    def append(self, log: str, lines: list[str]) -> None:
        """Append lines (without newlines) durably to ``log``."""

    def lines(self, log: str) -> list[str]:
        """Every complete line of ``log``, oldest first."""

    def child(self, name: str) -> StateStore:
        """The store one level down (a shard's directory)."""

    def children(self) -> list[str]:
        """Names of the sub-stores that hold a ``job.json``."""


def open_store(url: str, endpoint_url: str | None = None) -> StateStore:
    """A store for a directory or ``s3://bucket/prefix``."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[5:].partition("/")
        return S3Store(bucket, prefix.strip("/"), endpoint_url)
    return LocalStore(Path(url.removeprefix("file://")))


class LocalStore:
    """A directory; created on the first write only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        self.flush_interval_s = 0.0

    def exists(self, name: str) -> bool:
        return (self.root / name).is_file()

    def read(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.is_file() else None

    def write(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        temp = self.root / f".{name}.{uuid.uuid4().hex}.tmp"
        with temp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        temp.replace(self.root / name)

    def append(self, log: str, lines: list[str]) -> None:
        if not lines:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{log}.jsonl"
        with path.open("ab+") as handle:
            _cut_torn_line(handle)
            handle.write("".join(line + "\n" for line in lines).encode())
            handle.flush()
            os.fsync(handle.fileno())

    def lines(self, log: str) -> list[str]:
        path = self.root / f"{log}.jsonl"
        if not path.is_file():
            return []
        text = path.read_text()
        complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
        return [line for line in complete.splitlines() if line.strip()]

    def child(self, name: str) -> StateStore:
        return LocalStore(self.root / name)

    def children(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob("*/job.json"))


def _cut_torn_line(handle: Any) -> None:
    """Drop a last line without its newline (a writer killed mid-line)."""
    size = handle.seek(0, os.SEEK_END)
    if size == 0:
        return
    handle.seek(size - 1)
    if handle.read(1) == b"\n":
        return
    handle.seek(0)
    data = handle.read()
    handle.truncate(data.rfind(b"\n") + 1)
    handle.seek(0, os.SEEK_END)


class S3Store:
    """An S3 prefix; credentials and endpoint from the standard AWS chain."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None) -> None:
        import boto3

        self.bucket, self.prefix, self.endpoint_url = bucket, prefix, endpoint_url
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint_url)
        self.session = f"{uuid.uuid4().hex[:12]}"
        self.flush_interval_s = 2.0
        self.seq = 0

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def exists(self, name: str) -> bool:
        return self.read(name) is not None

    def read(self, name: str) -> bytes | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        return bytes(body.read())

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def append(self, log: str, lines: list[str]) -> None:
        if not lines:
            return
        self.seq += 1
        # Time-ordered part names: a resumed run's parts sort after the old ones.
        import time

        name = f"{log}/{time.time_ns():020d}-{self.session}-{self.seq:08d}.jsonl"
        self.write(name, "".join(line + "\n" for line in lines).encode())

    def lines(self, log: str) -> list[str]:
        out: list[str] = []
        for key in self._list(self._key(log) + "/"):
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            out.extend(line for line in body.decode().splitlines() if line.strip())
        return out

    def _list(self, prefix: str, delimiter: str | None = None) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        keys: list[str] = []
        pages = (
            paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter=delimiter)
            if delimiter
            else paginator.paginate(Bucket=self.bucket, Prefix=prefix)
        )
        for page in pages:
            keys.extend(o["Key"] for o in page.get("Contents", []))
            keys.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        return sorted(keys)

    def child(self, name: str) -> StateStore:
        return S3Store(self.bucket, self._key(name), self.endpoint_url)

    def children(self) -> list[str]:
        base = self._key("")
        names = [p[len(base) :].strip("/") for p in self._list(base, delimiter="/")]
        return [n for n in names if n and self.child(n).exists("job.json")]
