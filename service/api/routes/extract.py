"""``POST /extract``: answers once every prompt's object is durable."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from service.api.deps import NamespaceDep, StateDep
from service.api.errors import ApiError
from service.api.prompts import check_request_limits, tokenize_all
from service.api.schemas import (
    ErrorBody,
    ErrorDetail,
    ExtractRequest,
    ExtractResponse,
    PartialFailureBody,
    PromptOutcome,
    StoredObject,
    Usage,
)
from service.api.state import ApiState
from service.engine.extractor import (
    EngineUnavailableError,
    InvalidPromptError,
    StorageWriteError,
)

router = APIRouter()
T = TypeVar("T")
access_log = logging.getLogger("hsx.requests")

RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or invalid API key"},
    413: {"model": ErrorBody, "description": "Body over the size limit"},
    422: {"model": ErrorBody, "description": "Invalid prompt or a limit exceeded"},
    429: {"model": ErrorBody, "description": "Too much work queued; retry after Retry-After"},
    502: {"model": PartialFailureBody, "description": "Some objects could not be written"},
    503: {"model": PartialFailureBody, "description": "Engine unavailable or shutting down"},
    504: {"model": ErrorBody, "description": "Request deadline passed; its work was aborted"},
}


@router.post("/extract", response_model=ExtractResponse, responses=RESPONSES)
async def extract(
    body: ExtractRequest, request: Request, state: StateDep, namespace: NamespaceDep
) -> ExtractResponse:
    """Extract the hidden states of every prompt; one object per prompt."""
    return respond(state, await execute(body, request, state, namespace))


async def execute(
    body: ExtractRequest, request: Request, state: ApiState, namespace: str
) -> list[Any]:
    """Admit ``body`` and run its prompts: an outcome per prompt (Extraction or error).

    Limits, admission, deadline, disconnect and metrics, shared by every route that
    extracts (``/extract`` and the OpenAI routes).
    """
    assert state.metrics is not None
    token_ids = await admit(state, body)
    started = time.monotonic()
    try:
        work = run_prompts(state, body, token_ids, namespace)
        outcomes = await guard(request, work, state.settings.limits.request_timeout_s)
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


async def admit(state: ApiState, body: ExtractRequest) -> list[list[int]]:
    """Checks before the engine: limits, serving state, token ids, queue room."""
    assert state.metrics is not None
    try:
        check_request_limits(body, state.settings.limits)
        ensure_serving(state)
        token_ids: list[list[int]] = await prompt_token_ids(state, body)
        if not state.admission.try_admit(len(token_ids)):
            raise ApiError(
                429, "overloaded", "too much work queued; retry later", headers={"Retry-After": "1"}
            )
    except ApiError as error:
        state.metrics.rejected(error.detail.type)
        raise
    return token_ids


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


async def prompt_token_ids(state: ApiState, body: ExtractRequest) -> list[list[int]]:
    """Every prompt's token ids, checked against the limits (ApiError otherwise)."""
    extractor = state.extractor
    tokenize = partial(
        tokenize_all,
        body,
        extractor.tokenizer,
        vocab_size=extractor.info.vocab_size,
        max_model_len=extractor.max_model_len,
        limits=state.settings.limits,
    )
    if any(isinstance(p, str) or p.token_ids is None for p in body.prompts):
        return await run_in_threadpool(tokenize)  # the tokenizer, off the event loop
    return tokenize()  # token ids only need checking: cheaper than a thread hop


def ensure_serving(state: ApiState) -> None:
    if state.draining:
        raise ApiError(
            503, "unavailable", "the service is shutting down", headers={"Retry-After": "5"}
        )
    if not state.extractor.alive:
        raise ApiError(503, "unavailable", "the engine is dead")


async def run_prompts(
    state: ApiState, body: ExtractRequest, token_ids: list[list[int]], namespace: str
) -> list[Any]:
    """Every prompt concurrently; an outcome per prompt (an Extraction or the error)."""
    tasks = [
        asyncio.ensure_future(
            state.extractor.extract(
                ids,
                namespace=namespace,
                max_tokens=body.max_tokens,
                include_output_tokens=body.include_output_tokens,
                metadata=body.metadata,
            )
        )
        for ids in token_ids
    ]
    try:
        return await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        # Cancelled (disconnect, deadline): wait until every engine request is aborted.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def guard(request: Request, work: Awaitable[T], deadline_s: float) -> T:
    """``work``, unless the client disconnects (abort) or the deadline passes (504).

    The client's disconnect is seen as ASGI's ``http.disconnect`` message, as vLLM's
    own server does it: ``request.is_disconnected()`` misses it behind middleware.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait(
            {task, watch}, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
    finally:
        watch.cancel()
        if not task.done():  # disconnect, deadline, or this handler itself cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if watch in done:
        raise ApiError(499, "client_closed", "client disconnected; work aborted")
    raise ApiError(504, "timeout", f"request took longer than {deadline_s:g} s; work aborted")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def respond(state: ApiState, outcomes: list[Any]) -> ExtractResponse:
    """200 when every object is durable; else 502/503/422 listing every prompt's fate."""
    raise_failures(outcomes)
    extractor = state.extractor
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    generated = sum(len(o.output_token_ids) for o in outcomes)
    return ExtractResponse(
        id=f"ext-{uuid.uuid4().hex}",
        model=extractor.info.name,
        layer_ids=extractor.layer_ids,
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
            )
            for i, o in enumerate(outcomes)
        ],
        usage=Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + generated),
    )


def raise_failures(outcomes: list[Any]) -> None:
    """ApiError (502/503/422) listing every prompt's fate, if any prompt failed."""
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise _partial_failure(outcomes, errors)


#: Per-prompt failures: exception, its error type, and the request status it implies.
_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (EngineUnavailableError, "engine_unavailable"),
    (StorageWriteError, "storage_error"),
    (InvalidPromptError, "invalid_request"),
)


def _kind(error: BaseException) -> str:
    return next((kind for cls, kind in _FAILURES if isinstance(error, cls)), "internal_error")


def _request_failure(errors: list[BaseException]) -> tuple[int, str]:
    """The status and type of a request some of whose prompts failed."""
    kinds = {_kind(e) for e in errors}
    if "engine_unavailable" in kinds:
        return 503, "engine_unavailable"
    if "storage_error" in kinds:
        return 502, "storage_error"
    if kinds == {"invalid_request"}:
        return 422, "invalid_request"
    return 500, "internal_error"


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
    return PromptOutcome(index=index, error=ErrorDetail(type=kind, message=str(outcome) or kind))
