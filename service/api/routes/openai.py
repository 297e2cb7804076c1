"""vLLM's OpenAI dialect: completions, chat completions, render, tokenize, detokenize.

Requests parse with vLLM's protocol models and render with vLLM's renderer
(``service.api.openai_vllm``); prompts then run through the same path as ``/extract``
(limits, admission, deadline, disconnect, metrics), so an answer leaves only once
every object is durable; with ``stream: true`` it is vLLM's server-sent events
(``service.api.streaming``), each choice's final chunk sent once its object is durable.
Each choice carries ``kv_transfer_params`` naming its object
(``hidden_states_path``, ``handle``), as vLLM's ``extract_hidden_states`` connector
reports them, plus its ``codec``; the top level carries the first prompt's, without an
inline object's ``data`` (each object's bytes travel once, in its choice). hsx's own
fields travel in the extra body (``extra_body`` of OpenAI's clients): ``codec``,
``layers``, ``loss``, ``ttl_s`` and the rest of ``HsxExtras``, typed and checked as on
``/extract`` before anything is rendered (a near miss of their names is refused); a
chat request's mask is derived from its messages and tools and checked against vLLM's
render (``service.api.loss.chat_spans``), and each choice's ``kv_transfer_params``
carry ``num_loss_tokens``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, UsageInfo
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

from service.api import extraction, streaming
from service.api.deps import NamespaceDep, StateDep
from service.api.errors import ApiError
from service.api.extractor import FrontEnd
from service.api.job import ExtractOptions, Job
from service.api.loss import PromptSpans, chat_spans
from service.api.openai_protocol import (
    HsxExtras,
    OpenAIError,
    OpenAIRoute,
    bounded,
    finish_reason,
    hsx_extras,
    refuse_unsupported,
    requested_max_tokens,
    top_level_params,
    transfer_params,
)
from service.api.outcomes import successes
from service.api.pool import LoopRun, client_disconnected, in_pool, request_deadline
from service.api.prompts import check_request_limits
from service.api.schemas import ErrorBody
from service.api.state import ApiState
from service.api.tokenizing import check_token_ids
from service.engine.wire import Extraction
from service.masks import LossMode, MaskError

router = APIRouter(route_class=OpenAIRoute, tags=["openai"])
T = TypeVar("T")


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: "Invalid request, an unsupported field, or a limit exceeded (`param` names it)",
        404: "The model is not the served one",
        429: "Too much work queued; retry after Retry-After",
        502: "Some objects could not be written (`objects` lists every prompt's fate)",
        503: "Engine unavailable or shutting down",
        504: "Request deadline passed; its work was aborted",
    }
    return {
        **{s: {"model": ErrorResponse, "description": described[s]} for s in statuses},
        # Refused while reading, before any route: hsx's own error shape.
        413: {"model": ErrorBody, "description": "Body over the size limit"},
        # Validation errors are 400 here (vLLM's dialect), never FastAPI's 422.
        "4XX": {"model": ErrorResponse, "description": "Any other client error"},
    }


RENDER = _errors(400, 404)
# With `stream: true` the answer is server-sent events (``service.api.streaming``).
EXTRACT = {200: streaming.STREAMED, **_errors(400, 404, 429, 502, 503, 504)}


@router.post("/v1/completions", response_model=CompletionResponse, responses=EXTRACT)
@bounded("prompt", max_tokens=("max_tokens",), default=16)  # vLLM's default max_tokens
async def completions(
    body: CompletionRequest, request: Request, state: StateDep, namespace: NamespaceDep
) -> Response:
    """Hidden states of each prompt (token ids or text); answers once objects are durable
    (streamed: each prompt's final chunk once its object is)."""
    many = _is_list_of_prompts(body.prompt)
    field = "prompt[]" if many else "prompt"
    count = len(body.prompt) if many else 1
    vllm, options, extras = await _checked(state, body, count, field)
    if extras.loss not in ("none", "all"):
        message = f"loss: {extras.loss!r} needs a chat request; a completion takes 'all' or 'none'"
        raise OpenAIError(400, message, param="loss")
    render = partial(vllm.completion_token_ids, body)
    # Token ids only need checking (cheaper than a thread hop); text is tokenised.
    prompts = await (_vllm(render()) if _token_ids_only(body) else _render(request, state, render))
    spans: list[PromptSpans] = [((0, len(p)),) if extras.loss == "all" else None for p in prompts]
    custom_ids = extras.custom_ids(len(prompts))
    shares = _check_prompts(state, options, prompts, spans, custom_ids, field)
    job = Job(namespace, prompts, spans, custom_ids, options, _deadline(request, state), shares)
    if body.stream:
        decode = partial(_text, state, skip_special_tokens=body.skip_special_tokens)
        model = _model(state, body.model)
        chunks = streaming.CompletionChunks(body, model, prompts, options.max_tokens, decode)
        return await _stream(request, state, job, field, chunks)
    outcomes = await _extract(request, state, job, field)
    return JSONResponse(_completion(state, body, prompts, outcomes, options).model_dump())


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=EXTRACT)
@bounded("messages", max_tokens=("max_completion_tokens", "max_tokens"), default=1)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, namespace: NamespaceDep
) -> Response:
    """Hidden states of the rendered conversation; answers once the object is durable
    (streamed: the role at once, the final chunk once the object is durable)."""
    vllm, options, extras = await _checked(state, body, 1, "messages")
    prompt = await _render(request, state, partial(vllm.chat_token_ids, body))
    spans = [await _chat_spans(request, state, body, extras.loss, prompt)]
    custom_ids = extras.custom_ids(1)
    shares = _check_prompts(state, options, [prompt], spans, custom_ids, "messages")
    deadline = _deadline(request, state)
    job = Job(namespace, [prompt], spans, custom_ids, options, deadline, shares)
    if body.stream:
        decode = partial(_text, state, skip_special_tokens=body.skip_special_tokens)
        model = _model(state, body.model)
        chunks = streaming.ChatChunks(body, model, prompt, options.max_tokens, decode)
        return await _stream(request, state, job, "messages", chunks)
    (outcome,) = await _extract(request, state, job, "messages")
    return JSONResponse(_chat(state, body, prompt, outcome, options).model_dump())


@router.post("/v1/chat/completions/render", response_model=GenerateRequest, responses=RENDER)
@bounded("messages")
async def render_chat(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> JSONResponse:
    """The token ids vLLM renders for this chat request (no engine work, no object)."""
    render = partial(state.extractor.front_end.render_chat, body, request)
    return JSONResponse((await _render(request, state, render)).model_dump())


@router.post("/v1/completions/render", response_model=list[GenerateRequest], responses=RENDER)
@bounded("prompt")
async def render_completion(
    body: CompletionRequest, request: Request, state: StateDep
) -> JSONResponse:
    """The token ids vLLM renders for each prompt (no engine work, no object): at most
    ``max_prompts`` prompts and ``max_total_tokens`` tokens, as an extraction."""
    render = partial(state.extractor.front_end.render_completion, body, request)
    rendered = await _render(request, state, render)
    _check_total(state, sum(len(r.token_ids) for r in rendered), "prompt")
    return JSONResponse([r.model_dump() for r in rendered])


@router.post("/tokenize", response_model=TokenizeResponse, responses=RENDER)
@bounded("prompt")
async def tokenize(body: TokenizeRequest, request: Request, state: StateDep) -> JSONResponse:
    """Token ids of a prompt or a conversation, as vLLM's ``/tokenize``; past
    max_model_len a 400 (vLLM would answer any length)."""
    render = partial(state.extractor.front_end.tokenize, body, request)
    result = await _render(request, state, render)
    field = "messages" if hasattr(body, "messages") else "prompt"
    if result.count > state.extractor.max_model_len:
        message = f"{result.count} tokens; at most max_model_len {state.extractor.max_model_len}"
        raise _rejected(state, field, message)
    return JSONResponse(result.model_dump())


@router.post("/detokenize", response_model=DetokenizeResponse, responses=RENDER)
@bounded("tokens")
async def detokenize(body: DetokenizeRequest, request: Request, state: StateDep) -> JSONResponse:
    """The text of at most max_model_len token ids, as vLLM's ``/detokenize``."""
    render = partial(state.extractor.front_end.detokenize, body, request)
    return JSONResponse((await _render(request, state, render)).model_dump())


async def _checked(
    state: ApiState, body: Any, prompts: int, prompt_field: str
) -> tuple[FrontEnd, ExtractOptions, HsxExtras]:
    """Checks before rendering: the model (404), refused fields, hsx's extra fields
    (``codec``, ``layers``, ``loss``), prompt and token limits, and text too long to fit."""
    vllm = state.extractor.front_end
    wrong_model = await vllm.check_model(body.model)
    if wrong_model is not None:
        raise OpenAIError.from_vllm(wrong_model)
    try:
        refuse_unsupported(body)
        max_tokens = requested_max_tokens(body, "max_completion_tokens", "max_tokens")
        extras = hsx_extras(body)
        extras.custom_ids(prompts)  # one per prompt, before anything is rendered
        options = ExtractOptions.checked(
            state,
            max_tokens=max_tokens,
            include_output_tokens=extras.include_output_tokens,
            metadata=extras.metadata,
            loss=extras.loss,
            codec=extras.codec,
            layers=extras.layers,
            tokens=extras.tokens,
            ttl_s=extras.ttl_s,
            inline=extras.return_ == "inline",
        )
        check_request_limits(prompts, max_tokens, state.settings.limits)
    except OpenAIError:
        state.metrics.rejected("invalid_request")
        raise
    except ApiError as error:
        state.metrics.rejected(error.detail.type)
        raise OpenAIError.from_api_error(error, prompt_field) from None
    return vllm, options, extras


def _check_prompts(
    state: ApiState,
    options: ExtractOptions,
    prompts: list[list[int]],
    spans: list[PromptSpans],
    custom_ids: list[str | None],
    prompt_field: str,
) -> tuple[int, ...] | None:
    """The token selection and an inline answer's size against the rendered prompts,
    before the engine runs (``ExtractOptions.check_prompts``): a 400 naming ``tokens``
    or ``return``, vLLM's dialect of ``/extract``'s 422. Returns each inline object's
    share of the limit (None: stored)."""
    try:
        return options.check_prompts(state, prompts, spans, custom_ids)
    except ApiError as error:
        state.metrics.rejected(error.detail.type)
        raise OpenAIError.from_api_error(error, prompt_field) from None


async def _chat_spans(
    request: Request,
    state: ApiState,
    body: ChatCompletionRequest,
    loss: LossMode,
    rendered: list[int],
) -> PromptSpans:
    """The supervised ranges ``loss`` asks for in the rendered conversation (renders, so
    on the tokenizer pool within the deadline); an untrusted mask is a 400 on ``loss``."""
    if loss == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    compute = partial(chat_spans, state.extractor.tokenizer, body.messages, tools, loss, rendered)
    try:
        return await in_pool(state, compute, _deadline(request, state))
    except MaskError as exc:
        state.metrics.rejected("invalid_request")
        raise OpenAIError(400, f"loss: {loss!r}: {exc}", param="loss") from None


def _check_total(state: ApiState, tokens: int, field: str) -> None:
    """A rendered answer holds at most ``max_total_tokens`` tokens, as an extraction."""
    limit = state.settings.limits.max_total_tokens
    if tokens > limit:
        raise _rejected(state, field, f"{tokens} tokens in total; at most {limit}")


def _rejected(state: ApiState, field: str, message: str) -> OpenAIError:
    state.metrics.rejected("limit_exceeded")
    return OpenAIError(400, f"{field}: {message}", type="limit_exceeded", param=field)


def _deadline(request: Request, state: ApiState) -> float:
    return request_deadline(request, state.settings.limits.request_timeout_s)


async def _render(request: Request, state: ApiState, render: Callable[[], Awaitable[T]]) -> T:
    """A call into vLLM's renderer (the chat parser, the template, the tokenizer), run on
    the tokenizer pool within the request's deadline, never on the event loop."""
    run = LoopRun(render)
    return await _vllm(in_pool(state, run, _deadline(request, state), stop=run.cancel))


def _token_ids_only(body: CompletionRequest) -> bool:
    prompt = body.prompt
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)


async def _vllm(work: Awaitable[T]) -> T:
    """A call into vLLM's renderer; its errors become OpenAI errors, as in ``vllm serve``."""
    from vllm.exceptions import VLLMClientError

    try:
        result = await work
    except (VLLMClientError, ValueError, TypeError, OverflowError, NotImplementedError) as exc:
        raise OpenAIError.from_exception(exc) from None
    if isinstance(result, ErrorResponse):
        raise OpenAIError.from_vllm(result)
    return result


async def _extract(
    request: Request, state: ApiState, job: Job, prompt_field: str
) -> list[Extraction]:
    """Run the rendered prompts as ``/extract`` runs its own (``service.api.extraction``),
    once checked (``_check_job``); every object durable, or an error."""
    _check_job(state, job, prompt_field)
    try:
        return successes(await extraction.run(state, job, partial(client_disconnected, request)))
    except ApiError as error:
        raise OpenAIError.from_api_error(error, prompt_field) from None


async def _stream(
    request: Request, state: ApiState, job: Job, prompt_field: str, chunks: streaming.Chunks
) -> Response:
    """``stream: true``: ``_extract``'s checks and admission before the answer starts,
    then vLLM's chunks as the job runs (``service.api.streaming``)."""
    _check_job(state, job, prompt_field)
    return await streaming.open_stream(request, state, job, chunks, prompt_field)


def _check_job(state: ApiState, job: Job, prompt_field: str) -> None:
    """The rendered token ids checked as ``/extract`` checks token ids, while serving."""
    extractor = state.extractor
    try:
        with extraction.rejections(state):
            extraction.ensure_serving(state)
            check_token_ids(
                job.token_ids,
                job.options.max_tokens,
                vocab_size=extractor.info.vocab_size,
                max_model_len=extractor.max_model_len,
                limits=state.settings.limits,
            )
    except ApiError as error:
        raise OpenAIError.from_api_error(error, prompt_field) from None


def _completion(
    state: ApiState,
    body: Any,
    prompts: list[list[int]],
    outcomes: list[Extraction],
    options: ExtractOptions,
) -> CompletionResponse:
    """vLLM's completion answer; token ids only when asked, as vLLM gives them."""
    ids = bool(body.return_token_ids)
    params = [transfer_params(o) for o in outcomes]
    choices = [
        CompletionResponseChoice(
            index=i,
            text=_text(state, o.output_token_ids, body.skip_special_tokens),
            finish_reason=finish_reason(o, options.max_tokens),
            token_ids=list(o.output_token_ids) if ids else None,
            prompt_token_ids=prompts[i] if ids else None,
            kv_transfer_params=params[i],
        )
        for i, o in enumerate(outcomes)
    ]
    return CompletionResponse(
        model=_model(state, body.model),
        choices=choices,
        usage=_usage(outcomes),
        kv_transfer_params=top_level_params(params[0]),
    )


def _chat(
    state: ApiState, body: Any, prompt: list[int], outcome: Extraction, options: ExtractOptions
) -> ChatCompletionResponse:
    """vLLM's chat answer: ``prompt_token_ids`` at the top level, as vLLM puts them."""
    ids = bool(body.return_token_ids)
    text = _text(state, outcome.output_token_ids, body.skip_special_tokens)
    params = transfer_params(outcome)
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content=text),
        finish_reason=finish_reason(outcome, options.max_tokens),
        token_ids=list(outcome.output_token_ids) if ids else None,
        kv_transfer_params=params,
    )
    return ChatCompletionResponse(
        model=_model(state, body.model),
        choices=[choice],
        usage=_usage([outcome]),
        prompt_token_ids=prompt if ids else None,
        kv_transfer_params=top_level_params(params),
    )


def _is_list_of_prompts(prompt: Any) -> bool:
    """A list of strings or of token lists (a string or one token list is one prompt)."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _text(state: ApiState, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
    tokenizer = state.extractor.tokenizer
    if tokenizer is None or not token_ids:
        return ""
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def _model(state: ApiState, requested: str | None) -> str:
    return requested or state.model_name


def _usage(outcomes: list[Extraction]) -> UsageInfo:
    prompt = sum(o.prompt_tokens for o in outcomes)
    generated = sum(len(o.output_token_ids) for o in outcomes)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated
    )
