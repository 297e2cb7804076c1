"""From request prompts to checked token ids, before anything reaches the engine.

Tokenising is the one step whose cost a client picks: an 8 MB text took 20 s of CPU
and gigabytes of memory. So a text that cannot fit is refused from its size alone
(``check_text_sizes``): no token of the model is longer than ``max_token_bytes``
UTF-8 bytes, so a prompt of at most ``n`` tokens has at most ``n * max_token_bytes``
bytes of text. A chat prompt's text is everything a chat template can write of it
(``rendered_bytes``: every string, keys included, and every number of its messages,
tools, documents and template kwargs), plus one token per message (its role marker,
which every template writes), so 270k empty messages weigh 270k tokens, not 0 bytes;
and a request holds at most ``max_messages`` of them. Tokenising then runs prompt by
prompt and stops when told to.

The per-message cost (model validation, the chat parser, the template) is paid before
any token exists, so the bounds are checked on the JSON the client sent, before the
request model validates it (``BoundedBodyRoute``); a large body is parsed, checked and
validated on the tokenizer pool, under the request's deadline, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import email.message
import functools
import json
import logging
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from service.api.errors import ApiError
from service.api.schemas import ExtractRequest, Message, PromptObject
from service.config import LimitsSettings
from service.masks import conversation_ids

if TYPE_CHECKING:
    from service.api.state import ApiState

log = logging.getLogger(__name__)

#: Bytes per token assumed when the tokenizer cannot list its vocabulary.
FALLBACK_TOKEN_BYTES = 1024


class TokenizingStopped(Exception):
    """Tokenising was stopped (the request's deadline passed, or it was cancelled)."""


#: Errors that answer a client (hsx's, FastAPI's, vLLM's renderer's; any other with a
#: 4xx ``status``): no stack to log.
_CLIENT_ERRORS = (
    ApiError,
    RequestValidationError,
    HTTPException,
    TokenizingStopped,
    ValueError,
    TypeError,
    OverflowError,
    NotImplementedError,
)


def max_token_bytes(tokenizer: Any) -> int:
    """UTF-8 bytes of the model's longest token string: an upper bound on the text one
    token covers (byte-level BPE writes each byte as one character, SentencePiece its
    space as three bytes, byte-fallback tokens as six), so never an underestimate."""
    if tokenizer is None:
        return 0
    try:
        vocab = tokenizer.get_vocab()
        return max(len(str(token).encode()) for token in vocab) if vocab else 0
    except Exception:  # a tokenizer without a listable vocabulary: a loose bound
        log.warning("hsx: cannot list the tokenizer's vocabulary; assuming long tokens")
        return FALLBACK_TOKEN_BYTES


class TextSize(NamedTuple):
    """What one prompt would have rendered: UTF-8 bytes of text, and chat messages."""

    field: str
    bytes: int
    messages: int = 0


def rendered_bytes(value: Any) -> int:
    """UTF-8 bytes of every string (dict keys included) and the text of every number in
    ``value``, parsed JSON: all the renderer reads of it, which a template writes as
    text or with ``tojson``. No field list to keep up with vLLM's chat parser: content
    parts of every type, ``refusal``, ``thinking``, names, tool calls, tool schemas all
    count."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode())
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, int | float):  # bool too
            total += len(str(item))
    return total


def prompt_text_size(prompt: Any, field: str) -> TextSize:
    """An ``/extract`` prompt's text, as sent (a string or a JSON object) or validated."""
    if isinstance(prompt, PromptObject):
        prompt = prompt.model_dump(include={"text", "messages"}, exclude_none=True)
    if isinstance(prompt, str):
        return TextSize(field, rendered_bytes(prompt))
    if not isinstance(prompt, dict):
        return TextSize(field, 0)
    if isinstance(prompt.get("text"), str):
        return TextSize(f"{field}.text", rendered_bytes(prompt["text"]))
    messages = prompt.get("messages")
    if isinstance(messages, list) and messages:
        return TextSize(f"{field}.messages", rendered_bytes(messages), len(messages))
    return TextSize(field, 0)


def check_prompt_sizes(
    prompts: Sequence[Any],
    max_tokens: int,
    *,
    token_bytes: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> None:
    """Refuse ``/extract`` prompts (as sent or validated) whose messages are too many or
    whose text, from its size alone, cannot fit (422)."""
    check_message_count(sum(_message_count(p) for p in prompts), limits, "prompts")
    sizes = [prompt_text_size(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    check_text_sizes(
        sizes,
        max_tokens=max_tokens,
        token_bytes=token_bytes,
        max_model_len=max_model_len,
        limits=limits,
    )


def _message_count(prompt: Any) -> int:
    messages = prompt.get("messages") if isinstance(prompt, dict) else None
    if isinstance(prompt, PromptObject):
        messages = prompt.messages
    return len(messages) if isinstance(messages, list) else 0


def check_extract_body(raw: Any, state: ApiState) -> None:
    """``/extract``'s bounds on the JSON as sent, before validation (``body_check``):
    prompts, max_tokens, messages and text; malformed parts are left to validation."""
    prompts = raw.get("prompts") if isinstance(raw, dict) else None
    if not isinstance(prompts, list):
        return
    limits = state.settings.limits
    max_tokens = raw.get("max_tokens", 1)
    max_tokens = max_tokens if type(max_tokens) is int and max_tokens >= 1 else 1
    check_request_limits(len(prompts), max_tokens, limits)
    check_prompt_sizes(
        prompts,
        max_tokens,
        token_bytes=state.max_token_bytes,
        max_model_len=state.extractor.max_model_len,
        limits=limits,
    )


def check_message_count(messages: int, limits: LimitsSettings, field: str) -> None:
    """At most ``max_messages`` chat messages in a request (422 naming ``field``)."""
    if messages > limits.max_messages:
        raise _limit(field, f"{messages} chat messages; at most {limits.max_messages}")


def check_text_sizes(
    sizes: Sequence[TextSize],
    *,
    max_tokens: int,
    token_bytes: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> None:
    """Refuse prompts whose text cannot fit (422): a prompt of ``n`` tokens holds at most
    ``n * token_bytes`` bytes of text, and each chat message takes one token of its own.

    Shared by ``/extract`` and the OpenAI routes, whose renderer would otherwise
    tokenise whatever text a client sends.
    """
    per_prompt = max_model_len - max_tokens
    if token_bytes <= 0 or per_prompt < 1:
        return  # no tokenizer (text is refused later) or no room (tokenize_all says so)
    total = 0
    for index, size in enumerate(sizes):
        weight = size.bytes + size.messages * token_bytes
        if weight > per_prompt * token_bytes:
            raise _limit(
                size.field,
                f"{_text(size)} cannot fit in {per_prompt} tokens (max_model_len "
                f"{max_model_len} minus max_tokens {max_tokens}; no token of this model is "
                f"longer than {token_bytes} bytes{_per_message(size)})",
                index=index,
            )
        total += weight
        if total > limits.max_total_tokens * token_bytes:
            raise _limit(
                "prompts",
                f"more text than {limits.max_total_tokens} tokens can hold "
                f"(reached at prompt {index})",
                index=index,
            )


def _text(size: TextSize) -> str:
    text = f"{size.bytes} bytes of text"
    return f"{text} in {size.messages} messages" if size.messages else text


def _per_message(size: TextSize) -> str:
    return ", and each message takes a token of its own" if size.messages else ""


def check_request_limits(prompts: int, max_tokens: int, limits: LimitsSettings) -> None:
    """Limits that need no tokenizer: prompts per request and max_tokens."""
    if prompts > limits.max_prompts:
        raise _limit("prompts", f"{prompts} prompts; at most {limits.max_prompts}")
    if max_tokens > limits.max_tokens:
        raise _limit("max_tokens", f"{max_tokens}; at most {limits.max_tokens}")


def tokenize_all(
    request: ExtractRequest,
    tokenizer: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    limits: LimitsSettings,
    stop: threading.Event | None = None,
) -> list[list[int]]:
    """Token ids of every prompt; raises ApiError naming the prompt and field at fault.

    Checks ``stop`` before each prompt and raises TokenizingStopped once it is set.
    """
    prompts = [
        (_field(prompt, index), functools.partial(_token_ids, prompt, tokenizer, vocab_size, index))
        for index, prompt in enumerate(request.prompts)
    ]
    return _within_limits(prompts, request.max_tokens, max_model_len, limits, stop)


def check_token_ids(
    token_ids: Sequence[list[int]],
    max_tokens: int,
    *,
    vocab_size: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> list[list[int]]:
    """Prompts given as token ids (the OpenAI routes' renders), checked as ``/extract``
    checks ``token_ids`` prompts: the same limits, the same fields named."""
    prompts = [
        (f"prompts[{index}].token_ids", functools.partial(_checked_ids, ids, vocab_size, index))
        for index, ids in enumerate(token_ids)
    ]
    return _within_limits(prompts, max_tokens, max_model_len, limits)


def _within_limits(
    prompts: Sequence[tuple[str, Callable[[], list[int]]]],
    max_tokens: int,
    max_model_len: int,
    limits: LimitsSettings,
    stop: threading.Event | None = None,
) -> list[list[int]]:
    """Each prompt's token ids (``(field, ids)`` pairs), within ``max_model_len`` less
    ``max_tokens`` each and ``max_total_tokens`` in all."""
    per_prompt = max_model_len - max_tokens
    if per_prompt < 1:
        raise _limit(
            "max_tokens",
            f"{max_tokens} leaves no room for a prompt within max_model_len {max_model_len}",
        )
    result, total = [], 0
    for index, (field, token_ids) in enumerate(prompts):
        if stop is not None and stop.is_set():
            raise TokenizingStopped
        ids = token_ids()
        if len(ids) > per_prompt:
            raise _limit(
                field,
                f"{len(ids)} tokens; at most {per_prompt} (max_model_len {max_model_len} "
                f"minus max_tokens {max_tokens})",
                index=index,
            )
        total += len(ids)
        if total > limits.max_total_tokens:
            raise _limit(
                "prompts",
                f"more than {limits.max_total_tokens} tokens in total (reached at prompt {index})",
                index=index,
            )
        result.append(ids)
    return result


def _token_ids(
    prompt: str | PromptObject, tokenizer: Any, vocab_size: int, index: int
) -> list[int]:
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, index)
    elif prompt.text is not None:
        ids = _encode(tokenizer, prompt.text, index)
    elif prompt.messages is not None:
        ids = _render(tokenizer, prompt.messages, index)
    else:
        assert prompt.token_ids is not None
        return _checked_ids(prompt.token_ids, vocab_size, index)
    return _not_empty(ids, index)


def _checked_ids(token_ids: Sequence[int], vocab_size: int, index: int) -> list[int]:
    ids = list(token_ids)
    bad = next((t for t in ids if vocab_size and t >= vocab_size), None)
    if bad is not None:
        raise ApiError(
            422,
            "invalid_request",
            f"prompts[{index}].token_ids: {bad} is not below the vocabulary size {vocab_size}",
            field=f"prompts[{index}].token_ids",
            index=index,
        )
    return _not_empty(ids, index)


def _not_empty(ids: list[int], index: int) -> list[int]:
    if not ids:
        raise ApiError(
            422,
            "invalid_request",
            f"prompts[{index}]: the prompt has no tokens",
            field=f"prompts[{index}]",
            index=index,
        )
    return ids


def _encode(tokenizer: Any, text: str, index: int) -> list[int]:
    if tokenizer is None:
        raise ApiError(
            422,
            "invalid_request",
            f"prompts[{index}]: this model serves token ids only (no tokenizer)",
            field=f"prompts[{index}]",
            index=index,
        )
    return list(tokenizer.encode(text))


def _render(tokenizer: Any, messages: list[Message], index: int) -> list[int]:
    field = f"prompts[{index}].messages"
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            422,
            "invalid_request",
            f"{field}: the model has no chat template",
            field=field,
            index=index,
        )
    # Complete conversations are stored as is, others get the assistant's turn opened;
    # the same render the loss masks are computed from (service.masks).
    return conversation_ids(tokenizer, [m.model_dump() for m in messages])


def _field(prompt: str | PromptObject, index: int) -> str:
    if isinstance(prompt, str):
        return f"prompts[{index}]"
    name = "text" if prompt.text is not None else "messages" if prompt.messages else "token_ids"
    return f"prompts[{index}].{name}"


def _limit(field: str, message: str, *, index: int | None = None) -> ApiError:
    return ApiError(422, "limit_exceeded", f"{field}: {message}", field=field, index=index)


# --- Off the event loop: parsing, checking and rendering under the request's deadline ---

#: Bodies up to this size are parsed on the event loop (a thread hop costs more); larger
#: ones on the tokenizer pool, where the JSON parser and the model validation cannot
#: stall every other request (six 8 MB bodies once kept ``/health`` waiting 8 s).
POOL_BODY_BYTES = 64 * 1024
#: After a request with a body this large, freed heap goes back to the system.
TRIM_BODY_BYTES = 1024 * 1024
_DEADLINE = "hsx.deadline"
T = TypeVar("T")


def timeout_error(deadline_s: float) -> ApiError:
    return ApiError(504, "timeout", f"request took longer than {deadline_s:g} s; work aborted")


def request_deadline(request: Request, timeout_s: float) -> float:
    """The request's deadline (``time.monotonic``): set once its body has arrived."""
    deadline: float | None = request.scope.get(_DEADLINE)
    if deadline is None:
        deadline = request.scope[_DEADLINE] = time.monotonic() + timeout_s
    return deadline


async def client_disconnected(request: Request) -> None:
    """Return once the client has disconnected.

    The disconnect is seen as ASGI's ``http.disconnect`` message, as vLLM's own server
    does it: ``request.is_disconnected()`` misses it behind middleware.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def in_pool(
    state: ApiState, call: Callable[[], T], deadline: float, stop: Callable[[], None] | None = None
) -> T:
    """``call()`` on the bounded tokenizer pool; a 504 once ``deadline`` passes (``stop``
    is then called, and a call still queued never starts)."""
    pool = state.tokenizer_pool
    future: Future[tuple[bool, Any]] | None = pool.submit(_outcome, call)
    assert future is not None
    try:
        remaining = max(0.0, deadline - time.monotonic())
        done, value = await asyncio.wait_for(asyncio.wrap_future(future), remaining)
    except TimeoutError:
        raise timeout_error(state.settings.limits.request_timeout_s) from None
    finally:
        future.cancel()
        if stop is not None and not future.done():
            stop()
        future = None
    if done:
        return cast(T, value)
    try:
        raise value
    finally:
        value = None  # its traceback holds this frame


def _outcome(call: Callable[[], T]) -> tuple[bool, T | BaseException]:
    """``call()``'s result, or its error as a value (raised by the caller), detached
    from the pool thread's frames.

    Those frames link back (``f_back``) to the pool's work item, which holds the error:
    a reference cycle that kept each refused body (its parsed JSON: 70 MB for 8 MB of
    empty messages) alive until a full garbage collection. So the error leaves without
    its traceback; an unexpected one keeps the stack as a note, for the server log.
    """
    try:
        return True, call()
    except Exception as exc:
        if not isinstance(exc, _CLIENT_ERRORS) and getattr(exc, "status", 500) >= 500:
            exc.add_note(
                "in the tokenizer pool:\n" + "".join(traceback.format_tb(exc.__traceback__))
            )
        pending: list[BaseException | None] = [exc]
        while pending:
            current = pending.pop()
            if current is not None and current.__traceback__ is not None:
                current.__traceback__ = None
                pending += [current.__cause__, current.__context__]
        return False, exc


class LoopRun(Generic[T]):
    """A coroutine (vLLM's async renderer) run to its end on a private event loop in a
    pool thread: its parsing, templating and tokenising never touch the server's loop,
    and ``cancel`` (from any thread) stops it at its next ``await``."""

    def __init__(self, make: Callable[[], Awaitable[T]]) -> None:
        self._make, self._lock = make, threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[T] | None = None
        self._cancelled = False

    def __call__(self) -> T:
        loop = asyncio.new_event_loop()
        try:
            with self._lock:
                if self._cancelled:
                    raise TokenizingStopped
                self._task = loop.create_task(_awaited(self._make()))
                self._loop = loop
            return loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            raise TokenizingStopped from None
        finally:
            with self._lock:  # the task holds its error, whose traceback holds us
                self._loop, self._task = None, None
            loop.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._loop is not None and self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def release_memory_soon(state: ApiState) -> None:
    """Hand the heap a large request freed back to the system, shortly after its answer
    (glibc keeps freed chunks of every thread's arena resident otherwise: the server's
    RSS once stayed a gigabyte up after a large render)."""
    trim = _malloc_trim()
    pool = state.tokenizer_pool
    if trim is None:
        return

    def submit() -> None:
        with contextlib.suppress(RuntimeError):  # the pool shut down
            pool.submit(trim, 0)

    asyncio.get_running_loop().call_later(0.2, submit)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


BodyCheck = Callable[[Any, "ApiState"], None]
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def body_check(check: BodyCheck) -> Callable[[Endpoint], Endpoint]:
    """Give an endpoint of a ``BoundedBodyRoute`` a check of its JSON body as sent,
    ``check(raw, state)``, run before the body model validates it; it raises ApiError."""

    def mark(endpoint: Endpoint) -> Endpoint:
        endpoint.hsx_body_check = check  # type: ignore[attr-defined]
        return endpoint

    return mark


class BoundedBodyRoute(APIRoute):
    """A route whose JSON body hsx parses itself, so what a body costs is bounded first.

    The endpoint's ``body_check`` sees the parsed JSON before the request model
    validates it (vLLM's chat model took 2.5 s of CPU for 270k empty messages); a body
    over ``POOL_BODY_BYTES`` is parsed, checked and validated on the tokenizer pool
    within the request's deadline. FastAPI then gets the validated model (Starlette's
    cached ``Request.json()``), which it does not validate again, and errors keep
    FastAPI's shape. After a body of ``TRIM_BODY_BYTES`` the freed heap is returned.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        check: BodyCheck | None = getattr(self.endpoint, "hsx_body_check", None)

        async def route(request: Request) -> Response:
            state: ApiState = request.app.state.hsx
            body = await request.body() if self._parses_json(request) else b""
            deadline = request_deadline(request, state.settings.limits.request_timeout_s)
            try:
                if body:
                    parse = functools.partial(self._parse, body, check, state)
                    small = len(body) <= POOL_BODY_BYTES
                    parsed = parse() if small else await in_pool(state, parse, deadline)
                    request._json = parsed
                return await handler(request)
            finally:
                if len(body) >= TRIM_BODY_BYTES:
                    release_memory_soon(state)

        return route

    def _parses_json(self, request: Request) -> bool:
        """Whether FastAPI would read this body as JSON (its own test)."""
        if self.body_field is None:
            return False
        content_type = request.headers.get("content-type")
        if not content_type:
            return self.strict_content_type is False
        message = email.message.Message()
        message["content-type"] = content_type
        subtype = message.get_content_subtype()
        return message.get_content_maintype() == "application" and (
            subtype == "json" or subtype.endswith("+json")
        )

    def _parse(self, body: bytes, check: BodyCheck | None, state: ApiState) -> Any:
        try:
            raw = json.loads(body)
        except json.JSONDecodeError as exc:  # FastAPI's own answers to a bad body
            error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error"}
            raise RequestValidationError(
                [error | {"input": {}, "ctx": {"error": exc.msg}}]
            ) from exc
        except Exception as exc:
            raise HTTPException(400, "There was an error parsing the body") from exc
        if raw is None or self.body_field is None:
            return raw
        if check is not None:
            try:
                check(raw, state)
            except ApiError as error:
                state.metrics.rejected(error.detail.type)
                raise
        value, errors = self.body_field.validate(raw, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors)
        return value
