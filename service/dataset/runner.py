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

No worker can die silently: whatever a batch raises is caught at the batch and turns
into a decision or a requeue for each of its rows, with the reason (a 200 whose body is
not the expected JSON is ``bad_response``, transient like a 5xx; a row that cannot be
encoded is ``invalid_row``, failed alone; anything else is ``internal_error``, retried
until ``retries`` runs out). A worker that ends with an exception anyway, a manifest
that cannot be written, or rows that are neither queued, in flight nor decided stop
the run with that reason, so a run always ends (summary written, exit 0 or 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from service.client import AsyncHsxClient, BadResponseError, HsxError, encode_extract
from service.client.models import ExtractResponse, LayerStatistics, StoredObject
from service.dataset.answers import AnswerCheck, first_root
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
from service.dataset.replies import error_text, refusal_of
from service.dataset.statistics import STATISTICS, object_statistics, run_statistics
from service.dataset.store import OutputError, RunStore

T = TypeVar("T")
TRANSIENT = {500, 502, 503, 504}
#: Rows read ahead of the workers.
QUEUE_ROWS = 2048


@dataclass(eq=False)
class Item:
    row: Row
    attempts: int = 0
    last_error: str = ""
    #: The batch that holds the item now (None: queued, decided, or left pending).
    holder: object | None = None
    done: bool = False


@dataclass
class Endpoint:
    client: AsyncHsxClient
    errors_in_a_row: int = 0
    dropped: bool = False

    @property
    def url(self) -> str:
        return self.client.base_url


def counters_from(records: dict[int, Record], expected: int) -> Counters:
    """Counters that start from what earlier sessions decided (rates count this one)."""
    counters = Counters(expected=expected)
    for record in records.values():
        count_record(counters, record)
    counters.ok_before, counters.bytes_before = counters.ok, counters.bytes
    counters.decided_before = counters.decided
    counters.tokens = 0
    return counters


def printable(text: str) -> str:
    """``text`` without what cannot be written as UTF-8 (a lone surrogate becomes ``\\ud800``)."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode()


def warn(message: str) -> None:
    print(f"hsx dataset: {message}", file=sys.stderr, flush=True)


class Run:
    """One session of a run: feed, work, record, summarise."""

    def __init__(
        self,
        options: RunOptions,
        source: Source,
        store: RunStore,
        fingerprint: Fingerprint,
        clients: list[AsyncHsxClient],
        provenance: dict[str, str] | None = None,
    ) -> None:
        self.options, self.source, self.store = options, source, store
        self.fingerprint = fingerprint
        #: The server's provenance, recorded in a new (or forced) ``job.json``.
        self.provenance = provenance or {}
        self.endpoints = [Endpoint(client) for client in clients]
        self.extract_options = options.extract_options()
        where = options.input  # absolute, so verify finds it from anywhere
        self.input_url = where if where.startswith("s3://") else str(Path(where).resolve())
        self.max_length = fingerprint.max_length
        # Unbounded, so a worker putting work back never waits; the feeder keeps it short.
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.outstanding = 0  # rows queued or in flight, not yet decided
        self.busy = 0  # batches in the hands of a worker
        self.fed = False
        self.settled = asyncio.Event()
        self.room = asyncio.Event()
        self.stopped: str | None = None
        self.shard_rows = 0
        self.warned: set[str] = set()
        self.timeout = options.request_timeout
        #: The checks of every 200 (its namespace set from the manifest, in ``run``).
        self.check = AnswerCheck()

    async def run(self) -> Summary:
        """Feed, work and summarise; ends (with ``stopped`` set if it must) whatever fails.

        Raises only before anything is written (``OutputError`` when ``job.json``
        cannot be written), or when the summary itself cannot be written.
        """
        self.started = time.monotonic()
        records = await load_records(self.store)
        self.check.root = first_root([r.key for r in records.values() if r.key])
        total = await asyncio.to_thread(self.source.count)
        shards = self.options.shard[1] if self.options.shard else 1
        counters = counters_from(records, expected=-(-total // shards))
        self.total = total
        await self.write_job(total)
        self.recorder = Recorder(self.store, records, counters)
        self.display = Display(counters, self.options.progress)
        workers = [
            asyncio.create_task(self.worker(endpoint))
            for endpoint in self.endpoints
            for _ in range(self.options.concurrency)
        ]
        for task in workers:  # a worker that dies stops the run instead of leaving it idle
            task.add_done_callback(self.worker_ended)
        try:
            try:
                await self.feed(records)
            except Exception as exc:  # a reader failing mid-file, or a bug: stop, never hang
                self.stop(f"cannot read the input {self.options.input}: {describe(exc)}")
            await self.settled.wait()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            try:
                await self.recorder.flush()
            except Exception as exc:
                self.stop(f"cannot write the manifest to {self.store.url}: {describe(exc)}")
            self.display.close()
        return await self.finish(records)

    async def write_job(self, total: int) -> None:
        """``job.json`` for a new output (or a forced one): the run's first write."""
        if await self.store.read(JOB) is None or self.options.force:
            job = Job(
                fingerprint=self.fingerprint,
                input=self.input_url,
                input_rows=total,
                provenance=self.provenance,
            )
            try:
                await self.store.write(JOB, dumps(job))
            except Exception as exc:  # nothing is written yet: a bad --output
                raise OutputError(
                    f"--output {self.options.output}: cannot write {JOB}: {describe(exc)}"
                ) from None

    async def finish(self, records: dict[int, Record]) -> Summary:
        if self.stopped is not None:  # rows past the stop point still count as input rows
            try:
                self.shard_rows = await asyncio.to_thread(self.count_shard_rows)
            except Exception:  # the input broke mid-file: its row count from the start
                if self.options.shard is None:
                    self.shard_rows = self.total
        elapsed = time.monotonic() - self.started
        summary = summarise(records, self.shard_rows, self.stopped, elapsed)
        await self.store.write(SUMMARY, dumps(summary))
        # From the manifest's records, every session's: a resume recounts, never adds twice.
        stats = run_statistics(records.values(), self.fingerprint.layer_ids)
        await self.store.write(STATISTICS, dumps(stats))
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
            batch, broke = await asyncio.to_thread(read_some, rows, 256)
            for row in batch:  # the rows read before a reader broke still go
                await self.feed_one(row, records, seen)
            if broke is not None:
                raise broke
            if not batch:
                break
        self.fed = True
        self.check_settled()
        self.check_accounting()  # the workers may have finished before the last row was read

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
            reason=printable(reason),
            retryable=retryable,
        )
        self.recorder.add(record)
        self.display.update()

    def settle(self, item: Item, status: str, reason: str, *, retryable: bool = False) -> None:
        """Decide a queued row (once): its manifest line, and one fewer outstanding."""
        if item.done:
            return
        self.decide(item.row, status, reason, retryable=retryable)
        self.record_done(item)

    def record_done(self, item: Item) -> None:
        item.done, item.holder = True, None
        self.outstanding -= 1
        self.check_settled()

    async def put(self, item: Item) -> None:
        while self.queue.qsize() >= QUEUE_ROWS and self.stopped is None:
            self.room.clear()  # rows are read lazily: wait until the workers take some
            await self.room.wait()
        self.outstanding += 1
        self.queue.put_nowait(item)

    def check_settled(self) -> None:
        if (self.fed and self.outstanding == 0) or self.stopped is not None:
            self.settled.set()
            self.room.set()

    def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = printable(reason)
            warn(f"stopping: {self.stopped}")
        self.check_settled()

    def worker_ended(self, task: asyncio.Task[None]) -> None:
        """The supervisor's view of a worker: one that raised stops the run."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.stop(f"internal error: a worker stopped: {describe(exc)}")

    def warn_once(self, message: str) -> None:
        """A warning on stderr, once per distinct message (not once per batch)."""
        if message not in self.warned:
            self.warned.add(message)
            warn(message)

    def check_accounting(self) -> None:
        """Rows neither queued, in flight nor decided would leave the run idle: stop."""
        idle = self.fed and self.busy == 0 and self.queue.empty()
        if self.stopped is None and idle and self.outstanding != 0:
            self.stop(
                f"internal error: {self.outstanding} rows are neither queued, in flight nor decided"
            )

    # ------------------------------------------------------------ working

    async def worker(self, endpoint: Endpoint) -> None:
        while not endpoint.dropped and self.stopped is None:
            batch = [await self.queue.get()]
            while len(batch) < self.options.batch_size and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            holder = object()
            for item in batch:
                item.holder = holder
            self.busy += 1
            self.room.set()
            try:
                wait = await self.send(endpoint, batch)
            except Exception as exc:  # never lose a batch: its rows go back with the reason
                wait = await self.unexpected(batch, holder, exc)
            finally:
                self.busy -= 1
            try:
                await self.recorder.flush(False)
            except Exception as exc:
                self.stop(f"cannot write the manifest to {self.store.url}: {describe(exc)}")
                return
            self.display.update()
            self.check_accounting()
            if wait:
                await asyncio.sleep(wait)

    async def unexpected(self, batch: list[Item], holder: object, exc: Exception) -> float:
        """A batch raised what no branch expects: its undecided rows are retried."""
        error = f"internal_error: {describe(exc)}"
        self.warn_once(f"warning: a batch failed ({error}); its rows go back on the queue")
        mine = [item for item in batch if item.holder is holder and not item.done]
        for item in mine:
            item.attempts += 1
            item.last_error = error
        await self.requeue(mine)
        return 0.0

    async def send(self, endpoint: Endpoint, batch: list[Item]) -> float:
        """Send a batch; decide or requeue every item. Returns seconds to back off."""
        batch, content = self.encode(batch)
        if not batch:
            return 0.0
        try:
            answer = await self.within(endpoint.client.extract_encoded(content, len(batch)))
            objects = objects_of(answer, self.check)
        except TimeoutError:  # a body trickled a byte at a time: every read is in time
            reason = f"timeout: no whole answer within --request-timeout {self.timeout:g} s"
            return await self.transient(endpoint, batch, reason, None)
        except httpx.HTTPError as exc:  # AnswerTooLargeError too: a body over the cap
            return await self.transient(endpoint, batch, f"{type(exc).__name__}: {exc}", None)
        except BadResponseError as exc:  # a proxy's page, a truncated body: like a 5xx
            reason = f"bad_response: {exc.message}"
            self.warn_once(f"warning: {endpoint.url}: {reason}; retried as a 5xx")
            return await self.transient(endpoint, batch, reason, None)
        except HsxError as exc:
            return await self.failed(endpoint, batch, exc)
        endpoint.errors_in_a_row = 0
        await self.accepted(endpoint, batch, objects)
        return 0.0

    async def within(self, work: Awaitable[T]) -> T:
        """``work``, or TimeoutError once ``--request-timeout`` has passed: a deadline for
        the whole answer (httpx's timeout bounds each read only)."""
        async with asyncio.timeout(self.timeout):
            return await work

    async def failed(self, endpoint: Endpoint, batch: list[Item], error: HsxError) -> float:
        """An error answer: back off (429, 5xx), stop (401, 403, 404) or refuse."""
        if error.status == 429:
            await self.requeue(batch)
            return error.retry_after or self.options.backoff_base_s
        if error.status in TRANSIENT:
            return await self.transient(endpoint, batch, error_text(error), error.retry_after)
        if error.status in (401, 403, 404):
            for item in batch:  # pending: the next run sends them again
                item.holder = None
            self.stop(f"{endpoint.url} answered {error.status}: {error_text(error)}")
            return 0.0
        endpoint.errors_in_a_row = 0
        await self.refused(endpoint, batch, error)
        return 0.0

    def encode(self, batch: list[Item]) -> tuple[list[Item], bytes]:
        """The request body as bytes; a row that cannot be encoded fails alone
        (``invalid_row``), the rest of its batch goes on."""
        try:
            return batch, self.body(batch)
        except (ValueError, TypeError):  # UnicodeEncodeError is a ValueError
            pass
        kept = []
        for item in batch:
            try:
                self.body([item])
            except (ValueError, TypeError) as exc:
                self.settle(
                    item,
                    "failed",
                    f"invalid_row: row {item.row.index} ({item.row.custom_id}) cannot be "
                    f"sent as JSON: {describe(exc)}",
                )
            else:
                kept.append(item)
        return kept, (self.body(kept) if kept else b"")

    def body(self, batch: list[Item]) -> bytes:
        """The ``/extract`` body of a batch, each prompt with its row's ``custom_id``."""
        prompts = [{**i.row.prompt, "custom_id": i.row.custom_id} for i in batch]  # type: ignore[dict-item]
        return encode_extract(prompts, self.extract_options)

    async def accepted(
        self, endpoint: Endpoint, batch: list[Item], objects: dict[int, StoredObject]
    ) -> None:
        for position, item in enumerate(batch):
            obj = objects.get(position)
            if obj is None:  # not expected from hsx: an attempt, so it cannot loop forever
                item.attempts += 1
                item.last_error = f"{endpoint.url}: bad_response: 200 without this prompt's object"
                await self.requeue([item])
                continue
            await self.record_object(endpoint, item, obj)

    async def record_object(self, endpoint: Endpoint, item: Item, obj: StoredObject) -> None:
        if not self.options.include_output_tokens and obj.num_tokens > self.max_length:
            # Only the server counts text and message tokens: drop what is over the limit.
            # Else orphaned; skipped all the same.
            with contextlib.suppress(httpx.HTTPError, HsxError, TimeoutError):
                await self.within(endpoint.client.delete(obj.key))
            self.settle(item, "skipped", f"too_long: {obj.num_tokens} > {self.max_length}")
            return
        if item.done:
            return
        statistics = obj.statistics
        if statistics is None and obj.status == "found":
            statistics = await self.statistics_of(endpoint, obj)
            if item.done:
                return
        regenerated = obj.regenerated
        if regenerated is not None:
            self.recorder.regenerated.append(
                regenerated_line(item.row.index, item.row.custom_id, obj.key, regenerated)
            )
        self.recorder.add(
            Record(
                row=item.row.index,
                custom_id=item.row.custom_id,
                status="ok",
                key=obj.key,
                num_tokens=obj.num_tokens,
                num_loss_tokens=obj.num_loss_tokens,
                bytes=obj.bytes,
                sha256=obj.sha256,
                found=obj.status == "found",
                statistics=statistics,
                forward_tokens=None if regenerated is None else regenerated["forward_tokens"],
                recomputed_tokens=None if regenerated is None else regenerated["recomputed_tokens"],
            )
        )
        self.record_done(item)

    async def statistics_of(self, endpoint: Endpoint, obj: StoredObject) -> LayerStatistics | None:
        """The sums of a found object, which the server sends only for objects it writes
        (its engine did not run for this one); None if it cannot be read now: the row
        is stored all the same, and ``statistics.json`` counts it as without sums."""
        try:
            data = await self.within(endpoint.client.get_object(obj.key))
            return await asyncio.to_thread(object_statistics, data, self.fingerprint.codec)
        except Exception as exc:  # statistics never fail a row
            self.warn_once(f"warning: no statistics for found objects ({describe(exc)})")
            return None

    async def refused(self, endpoint: Endpoint, batch: list[Item], error: HsxError) -> None:
        """A 4xx for the request: the prompt it names fails, the others go again."""
        index = error.index
        if index is not None and 0 <= index < len(batch):
            self.settle(batch[index], *refusal_of(error))
            await self.requeue([item for i, item in enumerate(batch) if i != index])
        elif len(batch) == 1:
            self.settle(batch[0], *refusal_of(error))
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
            warn(
                f"dropping {endpoint.url} after {endpoint.errors_in_a_row} "
                f"errors in a row (last: {error})"
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
            if item.done:
                continue
            item.holder = None
            if item.attempts > self.options.retries:
                self.settle(
                    item,
                    "failed",
                    f"gave_up: {item.attempts} attempts, last: {item.last_error}",
                    retryable=True,
                )
            else:
                self.queue.put_nowait(item)


def regenerated_line(row: int, custom_id: str, key: str, regenerated: dict[str, Any]) -> str:
    """A ``regenerated.jsonl`` line: the row, its object, and its conversation as the
    target wrote it (messages, token ids as stored, each turn's span and finish)."""
    keep = ("messages", "token_ids", "turns", "seed", "settings", "input")
    record = {"row": row, "custom_id": custom_id, "key": key}
    record.update({name: regenerated[name] for name in keep if name in regenerated})
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def read_some(rows: Iterator[Row], count: int) -> tuple[list[Row], Exception | None]:
    """Up to ``count`` rows, and what the reader raised after them (None: it did not)."""
    batch: list[Row] = []
    try:
        for row in itertools.islice(rows, count):
            batch.append(row)
    except Exception as exc:  # the whole input's failure, not one row's (iter_rows keeps those)
        return batch, exc
    return batch, None


def objects_of(
    answer: ExtractResponse, check: AnswerCheck | None = None
) -> dict[int, StoredObject]:
    """The objects of an ``/extract`` answer by prompt index (the client has checked
    that each index is one of the batch's prompts; ``check``, the run's, that none
    repeats and every key is in the run's namespace). Raises BadResponseError."""
    return (check or AnswerCheck()).objects(answer)


def describe(exc: BaseException) -> str:
    """``Type: message``, on one line."""
    text = " ".join(str(exc).split())
    return printable(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
