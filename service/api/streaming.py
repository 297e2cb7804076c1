"""``stream: true`` on the OpenAI routes: server-sent events shaped as vLLM's.

The life of one stream:

1. The route checks, renders and bounds the request as without streaming: every
   refusal up to here is the same JSON error (400, 404, ...).
2. :func:`open_stream` admits the job, so a 429 or 503 is still an HTTP status, and the
   answer starts: 200, ``text/event-stream``. A chat stream sends vLLM's first chunk
   (``delta.role``) at once; a completion stream, as vLLM's, starts with text.
3. The prompts run as without streaming (``extraction.run_admitted``) while a watch
   listens for the client: gone, the engine work is aborted and counted
   (``hsx_extract_aborts_total{reason="disconnect"}``), and no object is left.
4. Once every object is durable, each prompt's final chunk: its text, its finish reason
   and, at the chunk's top level, its ``kv_transfer_params`` (what its choice carries
   without streaming), as vLLM 0.33 returns them "with the final chunk" (vllm PR
   #36308); then the usage chunk if ``stream_options.include_usage``, and
   ``data: [DONE]``. A failure after the start (deadline, storage) is one
   ``data: {"error": ...}`` event, the body a request without streaming would have got
   (vLLM's error shape), then ``[DONE]``.

The text comes with the objects, one delta per prompt, not token by token: the
extractor reports nothing before an object is durable (``ExtractorLike.extract``).
vLLM sends the same shapes when a choice's whole output lands in one engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from functools import partial
from typing import Any

from fastapi import Request
from pydantic import Field
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion import protocol as chat
from vllm.entrypoints.openai.completion import protocol as completion
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from service.api import extraction
from service.api.errors import ApiError
from service.api.job import Job
from service.api.openai_protocol import OpenAIError, finish_reason, transfer_params
from service.api.outcomes import successes
from service.api.pool import client_disconnected
from service.api.state import ApiState
from service.engine.wire import Extraction

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
#: The OpenAPI description of a streamed answer (its 200's second media type).
STREAMED = {
    "description": "The answer; with `stream: true`, server-sent events as vLLM's",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


class ChatCompletionStreamResponse(chat.ChatCompletionStreamResponse):
    """vLLM's chat chunk with vLLM 0.33's ``kv_transfer_params`` (absent in 0.32),
    set on the final chunk only."""

    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="KVTransfer parameters."
    )


class CompletionStreamResponse(completion.CompletionStreamResponse):
    """vLLM's completion chunk with vLLM 0.33's ``kv_transfer_params`` (absent in
    0.32), set on each choice's final chunk only."""

    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="KVTransfer parameters."
    )


Decode = Callable[[Sequence[int]], str]


class Chunks:
    """The chunks of one stream (:class:`ChatChunks`, :class:`CompletionChunks`): what
    all of them share (id, time, model, usage options) and when they are sent."""

    prefix = ""

    def __init__(self, body: Any, model: str, max_tokens: int, decode: Decode) -> None:
        self.body, self.model, self.max_tokens, self.decode = body, model, max_tokens, decode
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and bool(options.continuous_usage_stats)

    def opening(self) -> list[str]:
        """The events sent as soon as the job is admitted."""
        return []

    def closing(self, outcomes: Sequence[Extraction]) -> list[str]:
        """The events sent once every object is durable."""
        raise NotImplementedError

    def _usage(self, prompt: int, generated: int, *, each: bool = False) -> UsageInfo | None:
        """Usage of one chunk (``each``: continuous usage stats only), or of the stream."""
        if not (self.continuous if each else self.include_usage):
            return None
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated
        )


class ChatChunks(Chunks):
    """A chat stream's chunks, as vLLM's ``chat_completion_stream_generator`` writes them."""

    prefix = "chatcmpl"

    def __init__(
        self, body: Any, model: str, prompt: list[int], max_tokens: int, decode: Decode
    ) -> None:
        super().__init__(body, model, max_tokens, decode)
        self.prompt = prompt

    def opening(self) -> list[str]:
        """The role, with ``prompt_token_ids`` when asked, as vLLM's first chunk."""
        delta = DeltaMessage(role="assistant", content="")
        choice = chat.ChatCompletionResponseStreamChoice(
            index=0, delta=delta, logprobs=None, finish_reason=None
        )
        ids = self.prompt if self.body.return_token_ids else None
        usage = self._usage(len(self.prompt), 0, each=True)
        return [self._event(choice, prompt_token_ids=ids, usage=usage)]

    def closing(self, outcomes: Sequence[Extraction]) -> list[str]:
        """The text, finish reason and ``kv_transfer_params`` in one chunk; usage after."""
        (outcome,) = outcomes
        ids = list(outcome.output_token_ids)
        choice = chat.ChatCompletionResponseStreamChoice(
            index=0,
            delta=DeltaMessage(content=self.decode(ids)),
            logprobs=None,
            finish_reason=finish_reason(outcome, self.max_tokens),
            stop_reason=None,
            token_ids=ids if self.body.return_token_ids else None,
        )
        usage = self._usage(outcome.prompt_tokens, len(ids), each=True)
        final = self._event(choice, kv_transfer_params=transfer_params(outcome), usage=usage)
        total = self._usage(outcome.prompt_tokens, len(ids))
        return [final] if total is None else [final, self._event(None, usage=total)]

    def _event(self, choice: chat.ChatCompletionResponseStreamChoice | None, **fields: Any) -> str:
        """One chunk (none for the usage chunk), its fields given as vLLM gives them:
        null ones stay out only where vLLM leaves them out."""
        fields = {k: v for k, v in fields.items() if k != "usage" or v is not None}
        chunk = ChatCompletionStreamResponse(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=[] if choice is None else [choice],
            **fields,
        )
        return event(chunk.model_dump_json(exclude_unset=True, exclude_none=choice is None))


class CompletionChunks(Chunks):
    """A completion stream's chunks, as vLLM's ``completion_stream_generator`` writes
    them: one choice per prompt, ``index`` its prompt's."""

    prefix = "cmpl"

    def __init__(
        self, body: Any, model: str, prompts: list[list[int]], max_tokens: int, decode: Decode
    ) -> None:
        super().__init__(body, model, max_tokens, decode)
        self.prompts = prompts

    def closing(self, outcomes: Sequence[Extraction]) -> list[str]:
        """Each prompt's final chunk (text, finish reason, its ``kv_transfer_params``),
        in prompt order; the usage of all after."""
        events = [self._final(i, o) for i, o in enumerate(outcomes)]
        prompt = sum(o.prompt_tokens for o in outcomes)
        total = self._usage(prompt, sum(len(o.output_token_ids) for o in outcomes))
        if total is not None:
            chunk = CompletionStreamResponse(
                id=self.id, created=self.created, model=self.model, choices=[], usage=total
            )
            events.append(event(chunk.model_dump_json(exclude_unset=False, exclude_none=True)))
        return events

    def _final(self, index: int, outcome: Extraction) -> str:
        ids, asked = list(outcome.output_token_ids), bool(self.body.return_token_ids)
        choice = completion.CompletionResponseStreamChoice(
            index=index,
            text=self.decode(ids),
            logprobs=None,
            finish_reason=finish_reason(outcome, self.max_tokens),
            stop_reason=None,
            prompt_token_ids=self.prompts[index] if asked else None,
            token_ids=ids if asked else None,
        )
        fields: dict[str, Any] = {"kv_transfer_params": transfer_params(outcome)}
        usage = self._usage(outcome.prompt_tokens, len(ids), each=True)
        if usage is not None:
            fields["usage"] = usage
        chunk = CompletionStreamResponse(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=[choice],
            **fields,
        )
        return event(chunk.model_dump_json(exclude_unset=True))


def event(data: str) -> str:
    """One server-sent event carrying ``data`` (JSON: one line)."""
    return f"data: {data}\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` answer whose event generator is closed when the answer
    ends, however it ends, so that its cleanup runs then, not at garbage collection.

    Starlette's own watch for a disconnect is left out: it would cancel the stream
    unseen, where the extraction's watch aborts the engine work and counts it.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        finally:
            await self._events.aclose()


async def open_stream(
    request: Request, state: ApiState, job: Job, chunks: Chunks, prompt_field: str
) -> EventStream:
    """The streamed answer to ``job``, admitted (else the OpenAIError: 429, 503) and
    holding its room in the queue until the stream ends."""
    events = _events(request, state, job, chunks, prompt_field)
    try:
        await anext(events)  # runs up to the admission: nothing of the answer is sent
    except ApiError as error:
        raise OpenAIError.from_api_error(error, prompt_field) from None
    return EventStream(events)


async def _events(
    request: Request, state: ApiState, job: Job, chunks: Chunks, prompt_field: str
) -> AsyncGenerator[str, None]:
    """The stream's events; its first, empty, says the job was admitted."""
    # One watch for the whole stream: the extraction's guard waits on it (shielded, so
    # the guard's end does not stop it) and it still answers once objects are durable.
    gone = asyncio.ensure_future(client_disconnected(request))
    try:
        with extraction.admitted(state, len(job.token_ids)):
            yield ""
            for opening in chunks.opening():
                yield opening
            result = await _run(state, job, gone, prompt_field)
        if isinstance(result, list):
            answer = await _closing(state, job, chunks, result, gone)
        else:
            answer = result
        if answer is None:
            return  # the client has gone: nobody to tell
        for closing in [error_event(answer)] if isinstance(answer, OpenAIError) else answer:
            yield closing
        yield DONE
    finally:
        gone.cancel()


async def _run(
    state: ApiState, job: Job, gone: asyncio.Future[None], prompt_field: str
) -> list[Extraction] | OpenAIError | None:
    """Every object, durable; else what the client hears (None: it has gone)."""
    try:
        return successes(await extraction.run_admitted(state, job, partial(asyncio.shield, gone)))
    except ApiError as error:
        return None if error.status == 499 else OpenAIError.from_api_error(error, prompt_field)
    except Exception:
        log.exception("hsx: a streamed request failed")
        return _internal_error()


async def _closing(
    state: ApiState,
    job: Job,
    chunks: Chunks,
    outcomes: list[Extraction],
    gone: asyncio.Future[None],
) -> list[str] | OpenAIError | None:
    """The final events; else the objects, whose keys no client will learn, are removed
    and the client hears an internal error (None: it has gone)."""
    answer: OpenAIError | None = None
    try:
        if not gone.done():
            return chunks.closing(outcomes)
    except Exception:
        log.exception("hsx: a streamed answer could not be written")
        answer = _internal_error()
    await extraction.discard_unreported(state, job, list(enumerate(outcomes)))
    return answer


def error_event(error: OpenAIError) -> str:
    """An error once the stream has begun: the body an answer without streaming would
    carry, as vLLM sends its ``ErrorResponse`` in a stream."""
    return event(json.dumps(error.body()))


def _internal_error() -> OpenAIError:
    return OpenAIError(500, "internal error", type="internal_error")
