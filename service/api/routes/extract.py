"""``POST /extract``: answers once every prompt's object is durable."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Sequence
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Request

from service.api.codec_params import check_codec_params
from service.api.deps import NamespaceDep, StateDep
from service.api.errors import ApiError
from service.api.idempotency import Found, extract_once
from service.api.loss import PromptSpans, loss_spans
from service.api.prompts import (
    BoundedBodyRoute,
    body_check,
    check_extract_body,
    check_prompt_sizes,
    check_request_limits,
    in_pool,
    request_deadline,
    timeout_error,
    tokenize_all,
)
from service.api.schemas import (
    ErrorBody,
    ErrorDetail,
    ExtractRequest,
    ExtractResponse,
    PartialFailureBody,
    PromptObject,
    PromptOutcome,
    StoredObject,
    Usage,
)
from service.api.state import ApiState
from service.engine.errors import FAILURES, ExtractionError
from service.engine.wire import Extraction

# Bodies are parsed (large ones on the tokenizer pool) and bounded before validation.
router = APIRouter(route_class=BoundedBodyRoute)
T = TypeVar("T")
access_log = logging.getLogger("hsx.requests")
log = logging.getLogger(__name__)

RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or invalid API key"},
    409: {
        "model": PartialFailureBody,
        "description": "A custom_id's object was made by another request",
    },
    413: {"model": ErrorBody, "description": "Body over the size limit"},
    422: {"model": ErrorBody, "description": "Invalid prompt or a limit exceeded"},
    429: {"model": ErrorBody, "description": "Too much work queued; retry after Retry-After"},
    500: {
        "model": PartialFailureBody,
        "description": "States failed validation (invalid_hidden_states); nothing stored",
    },
    502: {"model": PartialFailureBody, "description": "Some objects could not be written"},
    503: {"model": PartialFailureBody, "description": "Engine unavailable or shutting down"},
    504: {"model": ErrorBody, "description": "Request deadline passed; its work was aborted"},
}


@router.post("/extract", response_model=ExtractResponse, responses=RESPONSES)
@body_check(check_extract_body)
async def extract(
    body: ExtractRequest, request: Request, state: StateDep, namespace: NamespaceDep
) -> ExtractResponse:
    """Extract the hidden states of every prompt; one object per prompt."""
    return respond(state, await execute(body, request, state, namespace))


async def execute(
    body: ExtractRequest,
    request: Request,
    state: ApiState,
    namespace: str,
    spans: list[PromptSpans] | None = None,
) -> list[Any]:
    """Admit ``body`` and run its prompts: an outcome per prompt (Extraction or error).

    Limits, admission, deadline, disconnect and metrics, shared by every route that
    extracts (``/extract`` and the OpenAI routes). ``spans``: loss masks the caller
    already derived (the OpenAI routes, from vLLM's render); else from ``body.loss``.
    """
    assert state.metrics is not None
    started = time.monotonic()
    deadline = request_deadline(request, state.settings.limits.request_timeout_s)
    token_ids, spans = await admit(state, body, deadline, spans)
    try:
        work = run_prompts(state, body, token_ids, namespace, spans)
        outcomes = await guard(request, work, deadline, state.settings.limits.request_timeout_s)
    except ApiError as error:  # disconnected or past the deadline: the work was aborted
        reason = "disconnect" if error.status == 499 else "deadline"
        state.metrics.aborted(reason, time.monotonic() - started)
        raise
    finally:
        state.admission.release(len(token_ids))
    elapsed = time.monotonic() - started
    state.metrics.record(outcome_of(outcomes), outcomes, elapsed)
    if state.settings.log_json:
        log_request(namespace, outcomes, elapsed)
    return outcomes


async def admit(
    state: ApiState, body: ExtractRequest, deadline: float, spans: list[PromptSpans] | None = None
) -> tuple[list[list[int]], list[PromptSpans]]:
    """Checks before the engine: limits, serving state, token ids, masks, queue room."""
    assert state.metrics is not None
    try:
        check_request_limits(len(body.prompts), body.max_tokens, state.settings.limits)
        ensure_serving(state)
        check_codec_params(state.extractor, body.codec, body.layers)
        token_ids: list[list[int]] = await prompt_token_ids(state, body, deadline)
        if spans is None:
            spans = await prompt_loss_spans(state, body, token_ids, deadline)
        if not state.admission.try_admit(len(token_ids)):
            raise ApiError(
                429, "overloaded", "too much work queued; retry later", headers={"Retry-After": "1"}
            )
    except ApiError as error:
        state.metrics.rejected(error.detail.type)
        raise
    return token_ids, spans


async def prompt_loss_spans(
    state: ApiState, body: ExtractRequest, token_ids: list[list[int]], deadline: float
) -> list[PromptSpans]:
    """Each prompt's supervised ranges (``loss``); renders, so on the tokenizer pool
    within the request's deadline."""
    compute = partial(loss_spans, body, state.extractor.tokenizer, token_ids)
    return compute() if body.loss == "none" else await in_pool(state, compute, deadline)


def outcome_of(outcomes: list[Any]) -> str:
    """The request's outcome label: ok, or the worst failure among its prompts."""
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    return _request_failure(errors)[1] if errors else "ok"


def log_request(namespace: str, outcomes: list[Any], elapsed: float) -> None:
    """One JSON line per request: what a log search needs, never a secret."""
    objects = [
        {
            "key": o.key,
            "bytes": o.size,
            "tokens": o.num_tokens,
            "copy_s": round(o.copy_s, 6),
            "write_s": round(o.write_s, 6),
        }
        if not isinstance(o, BaseException)
        else {"error": type(o).__name__}
        for o in outcomes
    ]
    access_log.info(
        json.dumps(
            {
                "event": "extract",
                "namespace": namespace,
                "duration_s": round(elapsed, 6),
                "objects": objects,
            }
        )
    )


async def prompt_token_ids(
    state: ApiState, body: ExtractRequest, deadline: float
) -> list[list[int]]:
    """Every prompt's token ids, checked against the limits (ApiError otherwise).

    Text that cannot fit is refused from its size; the rest is tokenised on the
    bounded tokenizer pool, within the request's deadline.
    """
    extractor = state.extractor
    check_prompt_sizes(
        body.prompts,
        body.max_tokens,
        token_bytes=state.max_token_bytes,
        max_model_len=extractor.max_model_len,
        limits=state.settings.limits,
    )
    stop = threading.Event()
    tokenize = partial(
        tokenize_all,
        body,
        extractor.tokenizer,
        vocab_size=extractor.info.vocab_size,
        max_model_len=extractor.max_model_len,
        limits=state.settings.limits,
        stop=stop,
    )
    if all(isinstance(p, PromptObject) and p.token_ids is not None for p in body.prompts):
        return tokenize()  # token ids only need checking: cheaper than a thread hop
    # Past the deadline, the thread stops before its next prompt.
    return await in_pool(state, tokenize, deadline, stop=stop.set)


def ensure_serving(state: ApiState) -> None:
    if state.draining:
        raise ApiError(
            503, "unavailable", "the service is shutting down", headers={"Retry-After": "5"}
        )
    if not state.extractor.alive:
        raise ApiError(503, "unavailable", "the engine is dead")


async def run_prompts(
    state: ApiState,
    body: ExtractRequest,
    token_ids: list[list[int]],
    namespace: str,
    spans: list[PromptSpans],
) -> list[Any]:
    """Every prompt concurrently; an outcome per prompt (an Extraction or the error).

    Cancelled (disconnect, deadline, shutdown), it aborts every engine request and
    removes the objects that were already written: no client will learn their keys.
    Objects still being written are removed by the extractor when they land.
    """
    tasks = [
        asyncio.ensure_future(run_prompt(state, body, index, ids, prompt_spans, namespace))
        for index, (ids, prompt_spans) in enumerate(zip(token_ids, spans, strict=True))
    ]
    returned = False
    try:
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        returned = True
        return outcomes
    finally:
        if not returned:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await discard_landed(state, body, tasks)


async def discard_landed(
    state: ApiState, body: ExtractRequest, tasks: Sequence[asyncio.Future[Any]]
) -> None:
    """Remove the objects of prompts that finished while their request was given up.

    Objects under a ``custom_id`` stay: they are found again when the client retries.
    """
    landed = [
        task.result().key
        for prompt, task in zip(body.prompts, tasks, strict=True)
        if not task.cancelled()
        and task.exception() is None
        and getattr(prompt, "custom_id", None) is None
    ]
    results = await asyncio.gather(
        *(state.extractor.storage.delete(key) for key in landed), return_exceptions=True
    )
    for key, result in zip(landed, results, strict=True):
        if isinstance(result, BaseException):
            log.error("hsx: could not remove unreported object %s: %s", key, result)


async def run_prompt(
    state: ApiState,
    body: ExtractRequest,
    index: int,
    ids: list[int],
    spans: PromptSpans,
    namespace: str,
) -> Extraction:
    """One prompt's object; with a custom_id, found or made at most once."""
    options: dict[str, Any] = {
        "namespace": namespace,
        "max_tokens": body.max_tokens,
        "include_output_tokens": body.include_output_tokens,
        "metadata": body.metadata,
        "loss_spans": spans,
        "codec": body.codec,
        "layers": body.layers,
    }
    custom_id = getattr(body.prompts[index], "custom_id", None)
    if custom_id is None:
        made: Extraction = await state.extractor.extract(ids, **options)
        return made
    return await extract_once(state, body, custom_id, ids, **options)


async def guard(request: Request, work: Awaitable[T], deadline: float, deadline_s: float) -> T:
    """``work``, unless the client disconnects (abort) or the deadline passes (504).

    The client's disconnect is seen as ASGI's ``http.disconnect`` message, as vLLM's
    own server does it: ``request.is_disconnected()`` misses it behind middleware.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
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
    raise timeout_error(deadline_s)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def respond(state: ApiState, outcomes: list[Any]) -> ExtractResponse:
    """200 when every object is durable; else 4xx/5xx listing every prompt's fate."""
    raise_failures(outcomes)
    extractor = state.extractor
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    generated = sum(len(o.output_token_ids) for o in outcomes)
    return ExtractResponse(
        id=f"ext-{uuid.uuid4().hex}",
        model=state.model_name,
        layer_ids=list(outcomes[0].layer_ids) or extractor.layer_ids,
        dtype=extractor.dtype,
        hidden_size=extractor.info.hidden_size,
        objects=[
            StoredObject(
                index=i,
                key=o.key,
                uri=o.uri,
                num_tokens=o.num_tokens,
                shape=list(o.shape),
                bytes=o.size,
                sha256=o.sha256,
                num_loss_tokens=o.num_loss_tokens,
                status="found" if isinstance(o, Found) else "created",
                codec=o.codec,
            )
            for i, o in enumerate(outcomes)
        ],
        codecs=extractor.codecs,
        usage=Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + generated),
    )


def raise_failures(outcomes: list[Any]) -> None:
    """ApiError (4xx/5xx) listing every prompt's fate, if any prompt failed."""
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise _partial_failure(outcomes, errors)


#: Error types, most severe first, and the request status each implies.
_SEVERITY = [error.error_type for error in FAILURES]
_STATUS = {error.error_type: error.status for error in FAILURES}


def _kind(error: BaseException) -> str:
    return error.error_type if isinstance(error, ExtractionError) else "internal_error"


def _request_failure(errors: list[BaseException]) -> tuple[int, str]:
    """The status and type of a request some of whose prompts failed: its worst prompt's."""
    worst = min((_kind(e) for e in errors), key=_SEVERITY.index)
    return _STATUS[worst], worst


def _partial_failure(outcomes: list[Any], errors: list[BaseException]) -> ApiError:
    status, kind = _request_failure(errors)
    per_prompt = [_outcome(i, o) for i, o in enumerate(outcomes)]
    failed = [p.index for p in per_prompt if p.error is not None]
    message = f"{len(failed)} of {len(outcomes)} prompts failed (indices {failed[:20]})"
    objects = [p.model_dump(exclude_none=True) for p in per_prompt]
    return ApiError(status, kind, message, index=failed[0], extra={"objects": objects})


def _outcome(index: int, outcome: Any) -> PromptOutcome:
    if not isinstance(outcome, BaseException):
        return PromptOutcome(index=index, key=outcome.key)
    kind = _kind(outcome)
    return PromptOutcome(index=index, error=ErrorDetail(type=kind, message=_message(kind, outcome)))


def _message(kind: str, error: BaseException) -> str:
    """What a client may read about a failed prompt: storage and internal details (paths,
    buckets, endpoints) go to the log only; the rest is about the prompt itself."""
    if kind not in _PRIVATE:
        return str(error) or kind
    log.warning("hsx: prompt failed (%s): %s", kind, error)
    return _PRIVATE[kind]


#: Failure types whose detail stays in the server log, and what the client reads instead.
_PRIVATE = {
    "storage_error": "storage: the object could not be written",
    "engine_unavailable": "the engine is not running",
    "internal_error": "internal error",
}
