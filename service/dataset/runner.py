"""``hsx dataset run``: every row of an input through one or more hsx servers.

One queue feeds ``concurrency`` workers per endpoint. A worker sends a batch of
prompts to ``POST /extract``, each with its row's ``custom_id`` (so a retry of a row
whose object was written, by any replica, returns that object instead of a second
one), and appends one manifest line per prompt once the answer says it is durable. A
transient failure (connection, 5xx, 504, 429) puts the prompts back on the queue for
any endpoint and backs the failing endpoint off (``Retry-After`` first); an endpoint
failing ``max_consecutive_errors`` times in a row is dropped, and the run stops when
none is left. What a prompt did wrong (422, 409) is that row's failure, never the
batch's.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.dataset.inputs import Row, Source, iter_rows, shard_of
from service.dataset.manifest import (
    JOB,
    SUMMARY,
    Fingerprint,
    Job,
    Record,
    Summary,
    dumps,
    load_records,
    summarise,
)
from service.dataset.options import RunOptions
from service.dataset.progress import Counters, Display
from service.dataset.recorder import Recorder, count_record
from service.dataset.replies import detail_of, error_of, outcome_of, retry_after
from service.dataset.store import StateStore

TRANSIENT = {500, 502, 503, 504}
#: Rows read ahead of the workers.
QUEUE_ROWS = 2048


@dataclass
class Item:
    row: Row
    attempts: int = 0
    last_error: str = ""


@dataclass
class Endpoint:
    url: str
    errors_in_a_row: int = 0
    dropped: bool = False


def counters_from(records: dict[int, Record], expected: int) -> Counters:
    """Counters that start from what earlier sessions decided (rates count this one)."""
    counters = Counters(expected=expected)
    for record in records.values():
        count_record(counters, record)
    counters.ok_before, counters.bytes_before = counters.ok, counters.bytes
    counters.decided_before = counters.decided
    counters.tokens = 0
    return counters


class Run:
    """One session of a run: feed, work, record, summarise."""

    def __init__(
        self,
        options: RunOptions,
        source: Source,
        store: StateStore,
        fingerprint: Fingerprint,
        client: httpx.AsyncClient,
        urls: list[str],
    ) -> None:
        self.options, self.source, self.store = options, source, store
        self.fingerprint, self.client = fingerprint, client
        self.endpoints = [Endpoint(url) for url in urls]
        self.max_length = fingerprint.max_length
        # Unbounded, so a worker putting work back never waits; the feeder keeps it short.
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.outstanding = 0
        self.fed = False
        self.settled = asyncio.Event()
        self.room = asyncio.Event()
        self.stopped: str | None = None
        self.shard_rows = 0

    async def run(self) -> Summary:
        self.started = time.monotonic()
        records = await asyncio.to_thread(load_records, self.store)
        total = await asyncio.to_thread(self.source.count)
        shards = self.options.shard[1] if self.options.shard else 1
        counters = counters_from(records, expected=-(-total // shards))
        await asyncio.to_thread(self.write_job, total)
        self.recorder = Recorder(self.store, records, counters)
        self.display = Display(counters, self.options.progress)
        workers = [
            asyncio.create_task(self.worker(endpoint))
            for endpoint in self.endpoints
            for _ in range(self.options.concurrency)
        ]
        try:
            await self.feed(records)
            await self.settled.wait()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.to_thread(self.recorder.flush)
            self.display.close()
        return await self.finish(records)

    def write_job(self, total: int) -> None:
        """``job.json`` for a new output (or a forced one)."""
        if self.store.read(JOB) is None or self.options.force:
            where = self.options.input  # absolute, so verify finds it from anywhere
            where = where if where.startswith("s3://") else str(Path(where).resolve())
            job = Job(fingerprint=self.fingerprint, input=where, input_rows=total)
            self.store.write(JOB, dumps(job))

    async def finish(self, records: dict[int, Record]) -> Summary:
        if self.stopped is not None:  # rows past the stop point still count as input rows
            self.shard_rows = await asyncio.to_thread(self.count_shard_rows)
        elapsed = time.monotonic() - self.started
        summary = summarise(records, self.shard_rows, self.stopped, elapsed)
        await asyncio.to_thread(self.store.write, SUMMARY, dumps(summary))
        return summary

    def in_shard(self, row: Row) -> bool:
        shard = self.options.shard
        return shard is None or shard_of(row.custom_id, shard[1]) == shard[0]

    def count_shard_rows(self) -> int:
        return sum(
            1 for row in iter_rows(self.source, self.options.id_column) if self.in_shard(row)
        )

    # ------------------------------------------------------------ feeding

    async def feed(self, records: dict[int, Record]) -> None:
        """Queue every row of the shard that the manifest has not decided for good."""
        seen: dict[str, int] = {}
        rows = iter_rows(self.source, self.options.id_column)
        while self.stopped is None:
            row = await asyncio.to_thread(_next_batch, rows, 256)
            if not row:
                break
            for one in row:
                await self.feed_one(one, records, seen)
        self.fed = True
        self.check_settled()

    async def feed_one(self, row: Row, records: dict[int, Record], seen: dict[str, int]) -> None:
        if not self.in_shard(row):
            return
        self.shard_rows += 1
        first = seen.setdefault(row.custom_id, row.index)
        old = records.get(row.index)
        if old is not None and old.final and old.custom_id == row.custom_id:
            return
        if first != row.index:
            self.decide(row, "skipped", f"duplicate: same custom_id as row {first}")
        elif row.error is not None:
            self.decide(row, "failed", row.error)
        elif row.num_tokens is not None and row.num_tokens > self.max_length:
            if self.options.on_long == "truncate":
                ids = row.prompt["token_ids"][: self.max_length]  # type: ignore[index]
                await self.put(Item(Row(row.index, row.custom_id, prompt={"token_ids": ids})))
            else:
                self.decide(row, "skipped", f"too_long: {row.num_tokens} > {self.max_length}")
        else:
            await self.put(Item(row))

    def decide(self, row: Row, status: str, reason: str, *, retryable: bool = False) -> None:
        record = Record(
            row=row.index,
            custom_id=row.custom_id,
            status=status,
            reason=reason,
            retryable=retryable,
        )
        self.recorder.add(record)
        self.display.update()

    async def put(self, item: Item) -> None:
        while self.queue.qsize() >= QUEUE_ROWS and self.stopped is None:
            self.room.clear()  # rows are read lazily: wait until the workers take some
            await self.room.wait()
        self.outstanding += 1
        self.queue.put_nowait(item)

    def done_with(self, count: int) -> None:
        self.outstanding -= count
        self.check_settled()

    def check_settled(self) -> None:
        if (self.fed and self.outstanding == 0) or self.stopped is not None:
            self.settled.set()
            self.room.set()

    def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            print(f"hsx dataset: stopping: {reason}", file=sys.stderr, flush=True)
        self.check_settled()

    # ------------------------------------------------------------ working

    async def worker(self, endpoint: Endpoint) -> None:
        while not endpoint.dropped and self.stopped is None:
            batch = [await self.queue.get()]
            while len(batch) < self.options.batch_size and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            self.room.set()
            wait = await self.send(endpoint, batch)
            await asyncio.to_thread(self.recorder.flush, False)
            self.display.update()
            if wait:
                await asyncio.sleep(wait)

    async def send(self, endpoint: Endpoint, batch: list[Item]) -> float:
        """Send a batch; decide or requeue every item. Returns seconds to back off."""
        try:
            response = await self.client.post(f"{endpoint.url}/extract", json=self.body(batch))
        except httpx.HTTPError as exc:
            return await self.transient(endpoint, batch, f"{type(exc).__name__}: {exc}", None)
        if response.status_code == 200:
            endpoint.errors_in_a_row = 0
            await self.accepted(endpoint, batch, response.json())
            return 0.0
        error = error_of(response)
        if response.status_code == 429:
            await self.requeue(batch)
            return retry_after(response) or self.options.backoff_base_s
        if response.status_code in TRANSIENT:
            return await self.transient(endpoint, batch, error, retry_after(response))
        if response.status_code in (401, 403, 404):
            self.done_with(len(batch))
            self.stop(f"{endpoint.url} answered {response.status_code}: {error}")
            return 0.0
        endpoint.errors_in_a_row = 0
        await self.refused(endpoint, batch, response)
        return 0.0

    def body(self, batch: list[Item]) -> dict[str, Any]:
        options = self.options
        body: dict[str, Any] = {
            "prompts": [{**i.row.prompt, "custom_id": i.row.custom_id} for i in batch],  # type: ignore[dict-item]
            "max_tokens": options.max_tokens,
            "include_output_tokens": options.include_output_tokens,
            "loss": options.loss,
        }
        if options.metadata:
            body["metadata"] = options.metadata
        if options.codec is not None:  # only when asked: servers without codecs still work
            body["codec"] = options.codec
        if options.layers is not None:
            body["layers"] = options.layers
        return body

    async def accepted(self, endpoint: Endpoint, batch: list[Item], body: dict[str, Any]) -> None:
        by_index = {int(o["index"]): o for o in body.get("objects", [])}
        for position, item in enumerate(batch):
            obj = by_index.get(position)
            if obj is None:  # not expected from hsx; send it again
                await self.requeue([item])
                continue
            await self.record_object(endpoint, item, obj)
        self.done_with(len(batch))

    async def record_object(self, endpoint: Endpoint, item: Item, obj: dict[str, Any]) -> None:
        row = item.row
        tokens = int(obj["num_tokens"])
        if not self.options.include_output_tokens and tokens > self.max_length:
            # Only the server counts text and message tokens: drop what is over the limit.
            await self.client.delete(f"{endpoint.url}/objects/{obj['key']}")
            self.decide(row, "skipped", f"too_long: {tokens} > {self.max_length}")
            return
        self.recorder.add(
            Record(
                row=row.index,
                custom_id=row.custom_id,
                status="ok",
                key=obj["key"],
                num_tokens=tokens,
                num_loss_tokens=obj.get("num_loss_tokens"),
                bytes=int(obj["bytes"]),
                sha256=obj["sha256"],
                found=obj.get("status") == "found",
            )
        )

    async def refused(
        self, endpoint: Endpoint, batch: list[Item], response: httpx.Response
    ) -> None:
        """A 4xx for the request: the prompt it names fails, the others go again."""
        detail = detail_of(response)
        index = detail.get("index")
        if isinstance(index, int) and 0 <= index < len(batch):
            self.decide(batch[index].row, *outcome_of(response.status_code, detail))
            self.done_with(1)
            await self.requeue([item for i, item in enumerate(batch) if i != index])
        elif len(batch) == 1:
            self.decide(batch[0].row, *outcome_of(response.status_code, detail))
            self.done_with(1)
        else:  # no prompt named: send each alone to find the culprit
            for item in batch:
                await self.send(endpoint, [item])

    async def transient(
        self, endpoint: Endpoint, batch: list[Item], error: str, retry_after: float | None
    ) -> float:
        endpoint.errors_in_a_row += 1
        for item in batch:
            item.attempts += 1
            item.last_error = f"{endpoint.url}: {error}"
        await self.requeue(batch)
        if endpoint.dropped:  # another worker's request already ended it
            return 0.0
        if endpoint.errors_in_a_row >= self.options.max_consecutive_errors:
            endpoint.dropped = True
            print(
                f"hsx dataset: dropping {endpoint.url} after {endpoint.errors_in_a_row} "
                f"errors in a row (last: {error})",
                file=sys.stderr,
                flush=True,
            )
            if all(e.dropped for e in self.endpoints):
                self.stop(
                    f"every endpoint failed {self.options.max_consecutive_errors} "
                    f"times in a row; last error: {error}"
                )
            return 0.0
        backoff = min(
            self.options.backoff_max_s,
            self.options.backoff_base_s * 2 ** (endpoint.errors_in_a_row - 1),
        )
        return max(retry_after or 0.0, random.uniform(backoff / 2, backoff))

    async def requeue(self, items: list[Item]) -> None:
        """Back on the shared queue (any endpoint), or failed once out of retries."""
        for item in items:
            if item.attempts > self.options.retries:
                self.decide(
                    item.row,
                    "failed",
                    f"gave_up: {item.attempts} attempts, last: {item.last_error}",
                    retryable=True,
                )
                self.done_with(1)
            else:
                self.queue.put_nowait(item)


def _next_batch(rows: Any, size: int) -> list[Row]:
    out = []
    for row in rows:
        out.append(row)
        if len(out) >= size:
            break
    return out
