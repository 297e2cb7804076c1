"""``POST /extract``: answers once every prompt's object is durable (or, with
``return: inline``, with every object's bytes, written nowhere)."""

from __future__ import annotations

import base64
import threading
import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter, Request

from service.api import extraction, regenerate
from service.api.bounded_route import BoundedBodyRoute, body_check
from service.api.deps import NamespaceDep, StateDep
from service.api.idempotency import Found
from service.api.job import ExtractOptions, Job
from service.api.loss import PromptSpans, loss_spans
from service.api.outcomes import successes
from service.api.pool import client_disconnected, in_pool, request_deadline
from service.api.prompts import check_extract_body, check_prompt_sizes, check_request_limits
from service.api.schemas import (
    ErrorBody,
    ExtractRequest,
    ExtractResponse,
    PartialFailureBody,
    PromptObject,
    StoredObject,
    Usage,
)
from service.api.state import ApiState
from service.api.tokenizing import tokenize_all
from service.engine.wire import Extraction

# Bodies are parsed (large ones on the tokenizer pool) and bounded before validation.
router = APIRouter(route_class=BoundedBodyRoute)

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
    deadline = request_deadline(request, state.settings.limits.request_timeout_s)
    with extraction.rejections(state):
        if body.regenerate is not None:
            job: Job = await regenerate.build_job(state, body, namespace, deadline)
        else:
            job = await _job(state, body, namespace, deadline)
    outcomes = await extraction.run(state, job, partial(client_disconnected, request))
    return _response(state, successes(outcomes))


async def _job(state: ApiState, body: ExtractRequest, namespace: str, deadline: float) -> Job:
    """The request checked and tokenised (ApiError otherwise): limits, serving state,
    codec and layers, each prompt's token ids and loss mask, the token selection."""
    check_request_limits(len(body.prompts), body.max_tokens, state.settings.limits)
    extraction.ensure_serving(state)
    options = ExtractOptions.checked(
        state,
        max_tokens=body.max_tokens,
        include_output_tokens=body.include_output_tokens,
        metadata=body.metadata,
        loss=body.loss,
        codec=body.codec,
        layers=body.layers,
        tokens=body.tokens,
        ttl_s=body.ttl_s,
        inline=body.return_ == "inline",
    )
    token_ids = await _token_ids(state, body, deadline)
    spans = await _loss_spans(state, body, token_ids, deadline)
    custom_ids = [getattr(prompt, "custom_id", None) for prompt in body.prompts]
    # Lengths known, no engine yet: the selections, and an inline answer's size.
    shares = options.check_prompts(state, token_ids, spans, custom_ids)
    return Job(namespace, token_ids, spans, custom_ids, options, deadline, shares)


async def _token_ids(state: ApiState, body: ExtractRequest, deadline: float) -> list[list[int]]:
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


async def _loss_spans(
    state: ApiState, body: ExtractRequest, token_ids: list[list[int]], deadline: float
) -> list[PromptSpans]:
    """Each prompt's supervised ranges (``loss``); renders, so on the tokenizer pool
    within the request's deadline."""
    compute = partial(loss_spans, body, state.extractor.tokenizer, token_ids)
    return compute() if body.loss == "none" else await in_pool(state, compute, deadline)


def _response(state: ApiState, objects: list[Extraction]) -> ExtractResponse:
    """200: every prompt's object is durable."""
    extractor = state.extractor
    prompt_tokens = sum(o.prompt_tokens for o in objects)
    generated = sum(len(o.output_token_ids) for o in objects)
    return ExtractResponse(
        id=f"ext-{uuid.uuid4().hex}",
        model=state.model_name,
        layer_ids=list(objects[0].layer_ids) or extractor.layer_ids,
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
                status="found" if isinstance(o, Found) or getattr(o, "found", False) else "created",
                codec=o.codec,
                statistics=o.statistics,
                data=None if o.data is None else base64.b64encode(o.data).decode(),
                transfer=None if o.transfer is None else o.transfer.model_dump(),
                regenerated=getattr(o, "regenerated", None),
            )
            for i, o in enumerate(objects)
        ],
        codecs=extractor.codecs,
        usage=Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + generated),
    )
