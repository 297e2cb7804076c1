"""Where a run keeps its state: a local directory or an S3 prefix, on ``service.storage``.

Documents (``job.json``, ``summary.json``) are objects of the output's storage, the
backend the server uses for its objects, with every one of its settings (S3 endpoint,
region, addressing style, retries, checksums; local files fsynced with their
directory). Logs (the manifest, ``errors.jsonl``) are append-only:

* on S3, which has no append, each flush of a log is a new object
  ``<log>/<time_ns>-<session>-<seq>.jsonl``, and reading a log lists them in key order
  (the storage's listing order), so a resumed run's parts follow the old ones;
* in a directory, a log is one file ``<log>.jsonl``, appended and fsynced (and its
  directory, when the append creates it); a line torn by a kill is cut off before the
  next append and never read.

Nothing is created before the first write: a refused run leaves no directory behind.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

from service.config import S3StorageSettings, StorageSettings
from service.storage import NotFoundError, Storage, open_backend, scheme_of


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


class _Output:
    """The output's storage, opened on first use and shared by its shards' stores."""

    def __init__(self, url: str, s3: S3StorageSettings | None) -> None:
        # Documents are replaced (a forced run's job.json, each session's summary).
        self.settings = StorageSettings(
            url=url, create_only=False, io_threads=4, s3=s3 or S3StorageSettings()
        )
        self.local = local_dir(url)
        self.session = uuid.uuid4().hex[:12]
        self.seq = 0
        self._storage: Storage | None = None

    def storage(self, create: bool) -> Storage | None:
        """The storage; None for a local directory not made yet, unless ``create``."""
        if self._storage is None:
            if self.local is not None and not create and not self.local.is_dir():
                return None
            self._storage = open_backend(self.settings)
        return self._storage

    async def close(self) -> None:
        if self._storage is not None:
            await self._storage.close()


def local_dir(url: str) -> Path | None:
    """The directory a local output names (a path or ``file://``); None for S3."""
    if scheme_of(url) != "file":
        return None
    from service.storage.local import root_from_url

    return root_from_url(url)


class RunStore:
    """A run's output location (or one shard's directory under it)."""

    def __init__(self, url: str, s3: S3StorageSettings | None = None) -> None:
        """``url``: a directory, ``file://...`` or ``s3://bucket/prefix``; ``s3``: the S3
        settings (``HSX_STORAGE__S3__*`` for the CLI), ignored for a directory."""
        self._output, self._base = _Output(url, s3), ""
        self.url = str(self._output.local) if self._output.local else url.rstrip("/")
        #: Seconds between flushes of a log (each S3 flush is a new object).
        self.flush_interval_s = 0.0 if self._output.local else 2.0

    def child(self, name: str) -> RunStore:
        """The store one level down (a shard's directory), on the same storage."""
        child = object.__new__(RunStore)
        child._output, child._base = self._output, f"{self._base}{name}/"
        child.url, child.flush_interval_s = f"{self.url}/{name}", self.flush_interval_s
        return child

    async def read(self, name: str) -> bytes | None:
        """The document ``name``, or None."""
        storage = self._output.storage(create=False)
        if storage is None:
            return None
        try:
            return await storage.get(self._base + name)
        except NotFoundError:
            return None

    async def write(self, name: str, data: bytes) -> None:
        """Replace the document ``name`` atomically and durably."""
        storage = self._output.storage(create=True)
        assert storage is not None
        await storage.put(self._base + name, data)

    async def append(self, log: str, lines: list[str]) -> None:
        """Append lines (without newlines) durably to ``log``."""
        if not lines:
            return
        storage = self._output.storage(create=True)
        assert storage is not None
        data = "".join(line + "\n" for line in lines).encode()
        if self._output.local is not None:
            await asyncio.to_thread(append_file, self._log_path(log), data)
            return
        self._output.seq += 1
        # Time-ordered part names: a resumed run's parts sort after the old ones.
        part = f"{time.time_ns():020d}-{self._output.session}-{self._output.seq:08d}"
        await storage.put(f"{self._base}{log}/{part}.jsonl", data)

    async def lines(self, log: str) -> list[str]:
        """Every complete line of ``log``, oldest first."""
        if self._output.local is not None:
            return await asyncio.to_thread(read_file_lines, self._log_path(log))
        storage = self._output.storage(create=False)
        assert storage is not None
        out: list[str] = []
        for key in await self._keys(storage, f"{log}/"):
            text = (await storage.get(key)).decode()
            out.extend(line for line in text.splitlines() if line.strip())
        return out

    async def children(self) -> list[str]:
        """Names of the sub-stores that hold a ``job.json``, in order."""
        storage = self._output.storage(create=False)
        if storage is None:
            return []
        names = []
        for key in await self._keys(storage, ""):
            name, _, rest = key[len(self._base) :].partition("/")
            if rest == "job.json":
                names.append(name)
        return names

    async def close(self) -> None:
        """Release the storage's threads and connections (all shards' at once)."""
        await self._output.close()

    async def _keys(self, storage: Storage, prefix: str) -> list[str]:
        keys: list[str] = []
        after: str | None = None
        while True:
            page = await storage.list(self._base + prefix, after=after)
            keys += [info.key for info in page.objects]
            if page.next_after is None:
                return keys
            after = page.next_after

    def _log_path(self, log: str) -> Path:
        assert self._output.local is not None
        return self._output.local / self._base / f"{log}.jsonl"


def append_file(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` and fsync it (and the directory of a new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("ab+") as handle:
        _cut_torn_line(handle)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if new:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def read_file_lines(path: Path) -> list[str]:
    """The complete, non-blank lines of a local log (none if it does not exist)."""
    if not path.is_file():
        return []
    text = path.read_text()
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    return [line for line in complete.splitlines() if line.strip()]


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
