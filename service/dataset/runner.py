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
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from service.dataset.endpoints import ServerInfo, auth_headers, probe_all
from service.dataset.inputs import Row, Source, iter_rows, open_source, shard_of
from service.dataset.manifest import (
    ERRORS,
    JOB,
    MANIFEST,
    SUMMARY,
    Fingerprint,
    Job,
    Record,
    Summary,
    check_fingerprint,
    dumps,
    error_line,
    load_records,
    summarise,
)
from service.dataset.options import RunOptions
from service.dataset.progress import Counters, Display
from service.dataset.store import StateStore, open_store

TRANSIENT = {500, 502, 503, 504}
#: Rows read ahead of the workers.
QUEUE_ROWS = 2048


class RunError(Exception):
    """The run cannot start (bad options for these servers)."""


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


class Recorder:
    """Manifest and error lines, buffered and flushed to the store off the event loop."""

    def __init__(self, store: StateStore, records: dict[int, Record], counters: Counters) -> None:
        self.store, self.records, self.counters = store, records, counters
        self.manifest: list[str] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.flushed = time.monotonic()

    def add(self, record: Record, attempts: int = 0) -> None:
        self.records[record.row] = record
        self.manifest.append(record.model_dump_json(exclude_none=True))
        if record.status != "ok":
            self.errors.append(error_line(record, attempts))
        _count(self.counters, record)

    def flush(self, force: bool = True) -> None:
        """Write the buffered lines (unless the store's interval has not passed)."""
        if not force and time.monotonic() - self.flushed < self.store.flush_interval_s:
            return
        self.flushed = time.monotonic()
        with self.lock:  # a cancelled to_thread keeps running: never two flushes at once
            manifest, self.manifest = self.manifest, []
            errors, self.errors = self.errors, []
            self.store.append(MANIFEST, manifest)
            self.store.append(ERRORS, errors)


def _count(counters: Counters, record: Record) -> None:
    if record.status == "ok":
        counters.ok += 1
        counters.tokens += record.num_tokens or 0
        counters.bytes += record.bytes or 0
    elif record.status == "failed":
        counters.failed += 1
    else:
        counters.skipped += 1


async def run_dataset_async(options: RunOptions) -> Summary:
    """Run (or resume) ``options``; the summary is also written to the output.

    Raises InputError, EndpointError, FingerprintMismatchError or RunError before
    anything is written.
    """
    source = open_source(options.input, options.id_column)
    timeout = httpx.Timeout(options.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=options.concurrency * len(options.endpoints) + 4)
    async with httpx.AsyncClient(
        headers=auth_headers(options.api_key), timeout=timeout, limits=limits
    ) as client:
        info, infos, warnings = await probe_all(client, options.endpoint_urls())
        for warning in warnings:
            print(
                f"hsx dataset: warning: {warning}; continuing without it",
                file=sys.stderr,
                flush=True,
            )
        fingerprint = make_fingerprint(options, info)
        root = open_store(options.output, options.s3_endpoint_url)
        name = options.shard_name()
        store = root.child(name) if name else root
        check_fingerprint(store, fingerprint, options.force)
        run = Run(options, source, store, fingerprint, client, [i.url for i in infos])
        return await run.run()


def make_fingerprint(options: RunOptions, info: ServerInfo) -> Fingerprint:
    """The run's fingerprint from its options and what the server serves."""
    limit = info.max_model_len - options.max_tokens
    if options.max_length is not None and options.max_length > limit:
        raise RunError(
            f"--max-length {options.max_length} is over the server's limit {limit} "
            f"(max_model_len {info.max_model_len} - max_tokens {options.max_tokens})"
        )
    if options.codec is not None and options.codec not in info.extra.get("codecs", ["raw"]):
        raise RunError(f"{info.url} does not offer codec {options.codec!r}")
    return Fingerprint(
        model=info.model,
        layer_ids=options.layers or info.layer_ids,
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        codec=options.codec or info.default_codec,
        tokenizer_sha256=info.tokenizer_sha256,
        chat_template_sha256=info.chat_template_sha256,
        loss=options.loss,
        max_length=options.max_length or limit,
        on_long=options.on_long,
        max_tokens=options.max_tokens,
        include_output_tokens=options.include_output_tokens,
        hsx_version=info.version,
        shard=f"{options.shard[0]}/{options.shard[1]}" if options.shard else None,
    )


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
        counters = Counters(expected=-(-total // shards))
        for record in records.values():
            _count(counters, record)
        counters.ok_before, counters.bytes_before = counters.ok, counters.bytes
        counters.decided_before = counters.decided
        counters.tokens = 0
        if self.store.read(JOB) is None or self.options.force:
            job = Job(fingerprint=self.fingerprint, input=self.options.input, input_rows=total)
            await asyncio.to_thread(self.store.write, JOB, dumps(job))
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
        error = _error_of(response)
        if response.status_code == 429:
            await self.requeue(batch)
            return _retry_after(response) or self.options.backoff_base_s
        if response.status_code in TRANSIENT:
            return await self.transient(endpoint, batch, error, _retry_after(response))
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
        detail = _detail(response)
        index = detail.get("index")
        if isinstance(index, int) and 0 <= index < len(batch):
            self.decide(batch[index].row, *_outcome(response.status_code, detail))
            self.done_with(1)
            await self.requeue([item for i, item in enumerate(batch) if i != index])
        elif len(batch) == 1:
            self.decide(batch[0].row, *_outcome(response.status_code, detail))
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


def _detail(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"message": response.text[:200]}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {"message": json.dumps(body)[:200]}


def _error_of(response: httpx.Response) -> str:
    detail = _detail(response)
    return f"{response.status_code} {detail.get('type', '')}: {detail.get('message', '')}".strip()


def _outcome(status: int, detail: dict[str, Any]) -> tuple[str, str]:
    """(status, reason) of a prompt the server refused."""
    kind, message = detail.get("type", ""), detail.get("message", "")
    if kind == "limit_exceeded" and "max_model_len" in message:
        return "skipped", f"too_long: {message}"
    if status == 409:
        return "failed", f"conflict: {message}"
    if status == 413:
        return "failed", f"too_large: {message}"
    return "failed", f"refused: {status} {kind}: {message}"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
