"""The run's manifest and error lines, buffered and flushed to its store."""

from __future__ import annotations

import asyncio
import time

from service.dataset.manifest import ERRORS, MANIFEST, REGENERATED, Record, error_line
from service.dataset.progress import Counters
from service.dataset.store import RunStore


class Recorder:
    """Manifest and error lines, buffered and flushed to the store."""

    def __init__(self, store: RunStore, records: dict[int, Record], counters: Counters) -> None:
        self.store, self.records, self.counters = store, records, counters
        self.manifest: list[str] = []
        self.errors: list[str] = []
        #: ``--regenerate``: each ok row's conversation, written before its manifest line.
        self.regenerated: list[str] = []
        self.lock = asyncio.Lock()
        self.flushed = time.monotonic()

    def add(self, record: Record, attempts: int = 0) -> None:
        self.records[record.row] = record
        self.manifest.append(record.model_dump_json(exclude_none=True))
        if record.status != "ok":
            self.errors.append(error_line(record, attempts))
        count_record(self.counters, record)

    async def flush(self, force: bool = True) -> None:
        """Write the buffered lines (unless the store's interval has not passed).

        The write runs as its own task, shielded from the caller: a worker cancelled
        mid-flush (the run ending) leaves it to finish, and the run's last flush waits
        for it on the lock instead of writing the same lines beside it.
        """
        if not force and time.monotonic() - self.flushed < self.store.flush_interval_s:
            return
        self.flushed = time.monotonic()
        task = asyncio.ensure_future(self._write())
        task.add_done_callback(_retrieved)
        await asyncio.shield(task)

    async def _write(self) -> None:
        """Lines a failed write did not take go back to the front of the buffers, so the
        next flush (the run's last one, at the latest) writes them or raises again."""
        async with self.lock:  # never two flushes at once
            regenerated, self.regenerated = self.regenerated, []
            try:
                await self.store.append(REGENERATED, regenerated)
            except BaseException:
                self.regenerated[:0] = regenerated
                raise
            manifest, self.manifest = self.manifest, []
            errors, self.errors = self.errors, []
            try:
                await self.store.append(MANIFEST, manifest)
            except BaseException:
                self.manifest[:0] = manifest
                self.errors[:0] = errors
                raise
            try:
                await self.store.append(ERRORS, errors)
            except BaseException:
                self.errors[:0] = errors
                raise


def _retrieved(task: asyncio.Task[None]) -> None:
    """A flush whose caller was cancelled still has its failure read (the last flush
    raises it again), so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def count_record(counters: Counters, record: Record) -> None:
    if record.status == "ok":
        counters.ok += 1
        counters.tokens += record.num_tokens or 0
        counters.bytes += record.bytes or 0
    elif record.status == "failed":
        counters.failed += 1
    else:
        counters.skipped += 1
