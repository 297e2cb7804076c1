"""The extraction service: what every route that extracts shares.

A route parses its body into a :class:`~service.api.job.Job` (token ids, loss spans,
custom_ids and :class:`~service.api.job.ExtractOptions`, each checked once) and hands it
to :func:`run`, which admits it
(serving state, queue room), runs every prompt concurrently under the request's
deadline and the client's connection, records metrics and the request log, and returns
an :data:`~service.api.outcomes.Outcome` per prompt. Given up (disconnect, deadline,
shutdown), it aborts the engine's requests and removes the objects no client will learn
of. ``/extract`` renders hsx's answer from the outcomes, the OpenAI routes vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

from service.api.errors import ApiError
from service.api.idempotency import extract_once
from service.api.job import ExtractOptions, Job
from service.api.outcomes import Outcome, as_outcome, error_name, outcome_of
from service.api.pool import timeout_error
from service.api.state import ApiState, ensure_serving
from service.engine.wire import Extraction
from service.storage.keys import new_object_key

T = TypeVar("T")
access_log = logging.getLogger("hsx.requests")
log = logging.getLogger(__name__)

__all__ = [
    "ExtractOptions",
    "Job",
    "Outcome",
    "admitted",
    "discard_unreported",
    "ensure_serving",
    "rejections",
    "run",
    "run_admitted",
]


Disconnected = Callable[[], Awaitable[None]]


@contextlib.contextmanager
def rejections(state: ApiState) -> Iterator[None]:
    """Count an ApiError raised in the block as a request refused before the engine."""
    try:
        yield
    except ApiError as error:
        state.metrics.rejected(error.detail.type)
        raise


@contextlib.contextmanager
def admitted(state: ApiState, prompts: int) -> Iterator[None]:
    """Hold room for ``prompts`` in the queue while the block runs.

    Raises ApiError before the block when the job is not admitted: 503 while the app
    drains or once the engine has died, 429 when the queue is full.
    """
    with rejections(state):
        ensure_serving(state)
        if not state.admission.try_admit(prompts):
            raise ApiError(
                429, "overloaded", "too much work queued; retry later", headers={"Retry-After": "1"}
            )
    try:
        yield
    finally:
        state.admission.release(prompts)


async def run(state: ApiState, job: Job, disconnected: Disconnected) -> list[Outcome]:
    """Admit ``job`` and run its prompts: an outcome per prompt, in order.

    Raises ApiError when it is not admitted (503 serving, 429 queue full), when the
    client disconnects (499) or the deadline passes (504); the work is then aborted.
    ``disconnected`` returns once the client has gone.
    """
    with admitted(state, len(job.token_ids)):
        return await run_admitted(state, job, disconnected)


async def run_admitted(state: ApiState, job: Job, disconnected: Disconnected) -> list[Outcome]:
    """:func:`run` for a job already :func:`admitted` (a stream admits it before its
    first byte, so that a refusal is still an HTTP status): the same errors but 429/503."""
    # From the body's arrival, when the request's deadline was set.
    started = job.deadline - state.settings.limits.request_timeout_s
    try:
        outcomes = await _guard(state, _run_prompts(state, job), job.deadline, disconnected)
    except ApiError as error:  # disconnected or past the deadline: the work was aborted
        reason = "disconnect" if error.status == 499 else "deadline"
        state.metrics.aborted(reason, time.monotonic() - started)
        raise
    elapsed = time.monotonic() - started
    state.metrics.record(outcome_of(outcomes), outcomes, elapsed)
    if state.settings.log_json:
        _log_request(job.namespace, outcomes, elapsed)
    return outcomes


async def _run_prompts(state: ApiState, job: Job) -> list[Outcome]:
    """Every prompt concurrently; an outcome per prompt (an Extraction or the error).

    Cancelled (disconnect, deadline, shutdown), it aborts every engine request and
    removes the objects that were already written: no client will learn their keys.
    Objects still being written are removed by the extractor when they land.
    """
    tasks = [asyncio.ensure_future(_run_prompt(state, job, i)) for i in range(len(job.token_ids))]
    returned = False
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
        returned = True
        return [as_outcome(result) for result in results]
    finally:
        if not returned:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _discard_landed(state, job, tasks)


async def _run_prompt(state: ApiState, job: Job, index: int) -> Extraction:
    """One prompt's object; with a custom_id, found or made at most once."""
    from service.api.regenerate import RegenerateJob, run_prompt

    if isinstance(job, RegenerateJob):  # every turn generated, then one object stored
        return await run_prompt(state, job, index)
    ids, spans, custom_id = job.token_ids[index], job.spans[index], job.custom_ids[index]
    options = job.options
    if custom_id is not None:
        return await extract_once(state, job.namespace, options, custom_id, ids, spans)
    key = new_object_key(state.settings.storage.key_prefix, job.namespace)
    params = job.params(index, key)
    return await state.extractor.extract(ids, params, max_tokens=options.max_tokens)


async def _discard_landed(
    state: ApiState, job: Job, tasks: Sequence[asyncio.Future[Extraction]]
) -> None:
    """Remove the objects of prompts that finished while their request was given up."""
    landed = [
        (index, task.result())
        for index, task in enumerate(tasks)
        if not task.cancelled() and task.exception() is None
    ]
    await discard_unreported(state, job, landed)


async def discard_unreported(
    state: ApiState, job: Job, landed: Sequence[tuple[int, Extraction]]
) -> None:
    """Remove the objects (prompt index, object) of a request given up before its client
    learnt their keys.

    Objects under a ``custom_id`` stay: they are found again when the client retries.
    Inline answers were stored nowhere.
    """
    keys = [
        extraction.key
        for index, extraction in landed
        if job.custom_ids[index] is None and extraction.data is None
    ]
    results = await asyncio.gather(
        *(state.storage.delete(key) for key in keys), return_exceptions=True
    )
    for key, result in zip(keys, results, strict=True):
        if isinstance(result, BaseException):
            log.error("hsx: could not remove unreported object %s: %s", key, result)


async def _guard(
    state: ApiState, work: Awaitable[T], deadline: float, disconnected: Disconnected
) -> T:
    """``work``, unless the client disconnects (abort) or the deadline passes (504)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait(
            {task, watch},
            timeout=max(0.0, deadline - time.monotonic()),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if task in done:
            return task.result()
    finally:
        watch.cancel()
        if not task.done():  # disconnect, deadline, or this handler itself cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled():  # finished just as the deadline or the disconnect came
        return task.result()
    if watch in done:
        raise ApiError(499, "client_closed", "client disconnected; work aborted")
    raise timeout_error(state.settings.limits.request_timeout_s)


def _log_request(namespace: str, outcomes: Sequence[Outcome], elapsed: float) -> None:
    """One JSON line per request: what a log search needs, never a secret."""
    objects = [
        {
            "key": o.key,
            "bytes": o.size,
            "tokens": o.num_tokens,
            "copy_s": round(o.copy_s, 6),
            "write_s": round(o.write_s, 6),
        }
        if isinstance(o, Extraction)
        else {"error": error_name(o)}
        for o in outcomes
    ]
    record = {
        "event": "extract",
        "namespace": namespace,
        "duration_s": round(elapsed, 6),
        "objects": objects,
    }
    access_log.info(json.dumps(record))
