"""The OpenAI dialect's edges: its error shape, what hsx refuses, what it answers.

Errors on the OpenAI routes use vLLM's ``ErrorResponse`` shape,
``{"error": {"message", "type", "param", "code"}}``, with ``param`` naming the field.
hsx's own refusals (limits, admission, storage) keep their type and status, except
that a 422 of ``/extract`` is the 400 a vLLM client expects.
"""

from __future__ import annotations

import base64
import difflib
import re
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import unquote, urlparse

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.api.errors import ApiError
from service.api.prompts import (
    BoundedBodyRoute,
    Endpoint,
    TextSize,
    body_check,
    check_message_count,
    check_request_limits,
    check_text_sizes,
    rendered_bytes,
)
from service.api.schemas import MAX_CUSTOM_ID, MetadataKey, MetadataValue, TokenSelectionField
from service.codecs import Codec
from service.engine.objects import reserved_keys
from service.masks import LossMode
from service.storage.expiry import MAX_TTL_S

if TYPE_CHECKING:
    from service.api.state import ApiState


class OpenAIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.headers, self.extra = headers, extra or {}

    def body(self) -> dict[str, Any]:
        """The answer's JSON: vLLM's ``ErrorResponse`` plus hsx's extra fields; also the
        ``data:`` of an error event once a stream has started."""
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": error | {"code": self.status}} | self.extra

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_vllm(cls, error: Any) -> OpenAIError:
        """From vLLM's ``ErrorResponse`` (its renderer's and model check's answers)."""
        info = error.error
        return cls(info.code, info.message, type=info.type, param=info.param)

    @classmethod
    def from_exception(cls, exc: Exception) -> OpenAIError:
        """An exception of vLLM's renderer, classified as vLLM's server does (a prompt
        over max_model_len is a 400 with ``param`` ``input_tokens``, as from vLLM)."""
        from vllm.entrypoints.serve import create_error_response

        return cls.from_vllm(create_error_response(exc))

    @classmethod
    def from_api_error(cls, error: ApiError, prompt_field: str) -> OpenAIError:
        """hsx's refusal in this dialect; ``prompts...`` fields become ``prompt_field``
        (``prompt``, ``prompt[]`` for a list of prompts, or ``messages``)."""
        detail = error.detail
        param, message = detail.field, detail.message
        if param is not None and param.startswith("prompts"):
            renamed = _rename(param, prompt_field)
            message = message.replace(param, renamed, 1)
            param = renamed
        status = 400 if error.status == 422 else error.status
        return cls(
            status, message, type=detail.type, param=param, headers=error.headers, extra=error.extra
        )


def _rename(field: str, prompt_field: str) -> str:
    """``prompts[2].token_ids`` -> ``prompt[2]``: the client's name for the prompt.

    ``prompt_field`` ending in ``[]`` means the client sent a list of prompts.
    """
    base = prompt_field.removesuffix("[]")
    found = re.match(r"prompts\[(\d+)\]", field)
    if found and prompt_field.endswith("[]"):
        return f"{base}[{found.group(1)}]"
    return base


class OpenAIRoute(BoundedBodyRoute):
    """Answers body validation errors and ``OpenAIError`` in the OpenAI shape (400).

    vLLM's request models raise its own client errors from their validators (an empty
    prompt, say), which pydantic lets through: they get vLLM's answer too. Bodies are
    bounded before validation, large ones off the event loop (``BoundedBodyRoute``);
    hsx's own errors that reach this far (a 504) keep their type and status.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        from vllm.exceptions import VLLMClientError

        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as error:
                return error.response()
            except RequestValidationError as exc:
                return _validation_error(exc).response()
            except VLLMClientError as exc:
                return OpenAIError.from_exception(exc).response()
            except ApiError as error:
                return OpenAIError.from_api_error(error, "prompt").response()

        return route


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    first = exc.errors()[0]
    parts = [p for p in first.get("loc", ()) if p != "body"]
    # Union branches pydantic tried ("ChatCompletionUserMessageParam", "list[int]",
    # "str") say nothing to the client: keep indices and snake_case field names.
    names = [p for p in parts if isinstance(p, int) or _is_field_name(p)]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in names).lstrip(".")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param or None)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_field_name(part: str) -> bool:
    return re.fullmatch(r"[a-z_][a-z0-9_]*", part) is not None and part not in _TYPE_NAMES


@dataclass(frozen=True)
class Refusal:
    """A field hsx cannot honour, unless it holds a neutral value."""

    field: str
    neutral: Callable[[Any], bool]
    reason: str


def _absent(value: Any) -> bool:
    return value in (None, False, [], {}, "")


_GREEDY = "hsx generates greedily and cannot honour it"
#: Fields of vLLM's completion and chat requests that hsx refuses (400) when set.
REFUSALS = (
    Refusal("n", lambda v: v in (None, 1), "one choice per prompt only"),
    Refusal("best_of", lambda v: v in (None, 1), "one choice per prompt only"),
    Refusal("use_beam_search", _absent, "beam search is not offered"),
    Refusal("logprobs", _absent, "logprobs are not computed"),
    Refusal("top_logprobs", lambda v: v in (None, 0), "logprobs are not computed"),
    Refusal("prompt_logprobs", lambda v: v is None, "prompt logprobs are not computed"),
    Refusal("echo", _absent, "echo is not offered"),
    Refusal("prompt_embeds", _absent, "hidden states need token ids, not embeddings"),
    Refusal(
        "kv_transfer_params",
        lambda v: v is None,
        "set by the server only: hsx makes every object's key and path itself",
    ),
    Refusal("ec_transfer_params", lambda v: v is None, "set by the server only"),
    Refusal("temperature", lambda v: v in (None, 0), _GREEDY),
    Refusal("presence_penalty", lambda v: v in (None, 0), _GREEDY),
    Refusal("frequency_penalty", lambda v: v in (None, 0), _GREEDY),
    Refusal("repetition_penalty", lambda v: v in (None, 1), _GREEDY),
    Refusal("logit_bias", _absent, _GREEDY),
    Refusal("bad_words", _absent, _GREEDY),
    Refusal("allowed_token_ids", _absent, _GREEDY),
    Refusal("stop", _absent, _GREEDY),
    Refusal("stop_token_ids", _absent, _GREEDY),
    Refusal("min_tokens", lambda v: v in (None, 0), _GREEDY),
    Refusal("ignore_eos", _absent, _GREEDY),
    Refusal("structured_outputs", lambda v: v is None, _GREEDY),
    Refusal("response_format", lambda v: v is None or getattr(v, "type", None) == "text", _GREEDY),
)


def _value(body: Any, name: str) -> Any:
    """A field's value, or an extra field's, without tripping deprecation warnings."""
    fields: dict[str, Any] = body.__dict__
    return fields[name] if name in fields else (body.model_extra or {}).get(name)


def refuse_unsupported(body: Any) -> None:
    """400 naming the first field of ``body`` hsx cannot honour."""
    for refusal in REFUSALS:
        value = _value(body, refusal.field)
        if not refusal.neutral(value):
            raise OpenAIError(400, f"{refusal.field}: {refusal.reason}", param=refusal.field)


CustomId = Annotated[str, Field(min_length=1, max_length=MAX_CUSTOM_ID)]


class HsxExtras(BaseModel):
    """hsx's fields in a request's extra body (``extra_body`` of OpenAI's clients),
    typed as on ``/extract``; whether the server offers them is checked after.

    They sit beside whatever else a client sends: unknown fields are ignored (vLLM's
    models log them), except a near miss of one of these names (:func:`hsx_extras`).
    """

    model_config = ConfigDict(strict=True, extra="ignore")

    codec: Codec | None = None
    layers: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    # As on /extract; ``assistant`` and ``last_turn`` need a chat request.
    loss: LossMode = "none"
    # As on /extract: a string for a request of one prompt, else one per prompt.
    custom_id: CustomId | list[CustomId] | None = None
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=64)
    include_output_tokens: bool = False
    tokens: TokenSelectionField = "all"
    return_: Literal["storage", "inline"] = Field("storage", alias="return")
    # As on /extract: the server's default (storage.default_ttl_s) when unset.
    ttl_s: int | None = Field(None, ge=1, le=MAX_TTL_S)

    def custom_ids(self, prompts: int) -> list[str | None]:
        """Each prompt's ``custom_id`` (None without one); 400 naming ``custom_id``
        unless there is one per prompt, all different."""
        given = self.custom_id
        if given is None:
            return [None] * prompts
        ids = [given] if isinstance(given, str) else given
        if len(ids) != prompts or len(set(ids)) != len(ids):
            message = f"custom_id: give {prompts} different ids, one per prompt, in order"
            raise OpenAIError(400, message, param="custom_id")
        return list(ids)


#: hsx's field names as a client sends them.
HSX_FIELDS = frozenset(f.alias or name for name, f in HsxExtras.model_fields.items())
#: How alike (difflib's ratio) an unknown field's name must be to one of hsx's to be
#: taken for it misspelled: ``tokns`` is 0.91 from ``tokens``, ``ttl`` 0.75 from ``ttl_s``.
NEAR_MISS = 0.75


def hsx_extras(body: Any) -> HsxExtras:
    """hsx's extra fields a client sent; 400 naming the field if mistyped, if its name
    is a near miss of one of hsx's, or if it was put in ``vllm_xargs``."""
    extra = body.model_extra or {}
    _refuse_near_misses(extra, frozenset(type(body).model_fields))
    _refuse_xargs(_value(body, "vllm_xargs"))
    try:
        extras = HsxExtras.model_validate(extra)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first["loc"]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        raise OpenAIError(400, f"{param}: {first['msg']}", param=param) from None
    reserved = reserved_keys(extras.metadata)
    if reserved:
        raise OpenAIError(400, f"metadata: keys {reserved} are reserved", param="metadata")
    return extras


def _refuse_near_misses(extra: Mapping[str, Any], vllm_fields: frozenset[str]) -> None:
    """400 naming an unknown field whose name is nearer one of hsx's than any of vLLM's:
    ignored, as vLLM ignores unknown fields, ``tokns`` would store every token."""
    for name in extra:
        if name in HSX_FIELDS:
            continue
        nearest = difflib.get_close_matches(name, HSX_FIELDS | vllm_fields, n=1, cutoff=NEAR_MISS)
        if nearest and nearest[0] in HSX_FIELDS:
            message = f"{name}: unknown field; did you mean {nearest[0]!r}?"
            raise OpenAIError(400, message, param=name)


def _refuse_xargs(xargs: Any) -> None:
    """400 naming an hsx field sent in ``vllm_xargs``: hsx reads its fields from the
    body's top level, and passes no ``vllm_xargs`` on."""
    for name in xargs if isinstance(xargs, dict) else ():
        if name in HSX_FIELDS:
            param = f"vllm_xargs.{name}"
            message = f"{param}: hsx's fields go at the top level of the body (extra_body)"
            raise OpenAIError(400, message, param=param)


#: What a chat template gets besides the messages (vLLM's chat parameters pass them on).
TEMPLATE_INPUTS = ("tools", "tool_choice", "documents", "chat_template_kwargs", "response_format")


def chat_text(raw: dict[str, Any]) -> TextSize:
    """A chat request's text, as sent: every string and number of its messages and of
    the template's other inputs (``rendered_bytes``), and its message count."""
    messages = raw.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    inputs = [messages, *(raw.get(name) for name in TEMPLATE_INPUTS)]
    return TextSize("messages", rendered_bytes(inputs), count)


def prompt_texts(raw: dict[str, Any]) -> list[TextSize]:
    """Each text prompt of a completion request (with its FIM ``suffix``), as sent."""
    prompt, suffix = raw.get("prompt"), rendered_bytes(raw.get("suffix"))
    if isinstance(prompt, str):
        return [TextSize("prompt", rendered_bytes(prompt) + suffix)]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return [TextSize(f"prompt[{i}]", rendered_bytes(p) + suffix) for i, p in enumerate(prompt)]
    return []  # token ids: their count is checked, not their text


def bounded(
    prompt_field: str, *, max_tokens: tuple[str, ...] = (), default: int = 0
) -> Callable[[Endpoint], Endpoint]:
    """``body_check`` of an OpenAI route: the bounds of ``check_openai_body`` on the JSON
    as sent, a 400 in this dialect naming the field. ``max_tokens``: the fields that say
    how many tokens are generated (``default`` when none is sent; 0: render only)."""

    def check(raw: Any, state: ApiState) -> None:
        if not isinstance(raw, dict):
            return  # validation refuses it
        try:
            check_openai_body(raw, state, _max_tokens(raw, max_tokens, default))
        except ApiError as error:
            state.metrics.rejected(error.detail.type)
            raise OpenAIError.from_api_error(error, prompt_field) from None

    return body_check(check)


def check_openai_body(raw: dict[str, Any], state: ApiState, max_tokens: int) -> None:
    """Prompts (``max_prompts``), chat messages (``max_messages``), token ids to decode
    (``max_model_len``) and text that cannot fit, before any of it is validated,
    parsed as chat or rendered."""
    limits, max_model_len = state.settings.limits, state.extractor.max_model_len
    tokens = raw.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_model_len:  # /detokenize
        message = f"tokens: {len(tokens)} token ids; at most max_model_len {max_model_len}"
        raise ApiError(422, "limit_exceeded", message, field="tokens")
    prompt = raw.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        check_request_limits(len(prompt), 0, limits)
    sizes = prompt_texts(raw)
    messages = raw.get("messages")
    if isinstance(messages, list):  # counted first: their text is walked next
        check_message_count(len(messages), limits, "messages")
        sizes = [chat_text(raw)]
    check_text_sizes(
        sizes,
        max_tokens=max_tokens,
        token_bytes=state.max_token_bytes,
        max_model_len=max_model_len,
        limits=limits,
    )


def _max_tokens(raw: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    """Tokens to generate as the client asked; a wrong value is refused after validation."""
    for name in names:
        value = raw.get(name)
        if value is not None:
            return value if type(value) is int and value >= 0 else default
    return default


def requested_max_tokens(body: Any, *names: str) -> int:
    """The first of ``names`` the client sent, else 1.

    Completions always have one: vLLM's model fills in its default of 16. Chat's
    default in vLLM is the rest of the context; hsx's is 1, as on ``/extract``.
    """
    for name in names:
        value = _value(body, name)
        if name in body.model_fields_set and value is not None:
            if value < 1:
                raise OpenAIError(400, f"{name}: must be at least 1", param=name)
            return int(value)
    return 1


def hidden_states_path(uri: str) -> str:
    """What vLLM's connector puts in ``hidden_states_path``: a local file path (a
    client on a shared filesystem reads or moves it), or the ``s3://`` URI."""
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri


def transfer_params(extraction: Any) -> dict[str, Any]:
    """``kv_transfer_params`` of one durable object, as vLLM's clients read them; an
    object answered inline (``return: inline``) adds ``data``, its safetensors bytes in
    base64, and has no path or uri.

    An object in Mooncake (``mooncake://`` storage) is answered as hs-connectors'
    Mooncake connector answers: its transfer manifest (``handle``, ``version``,
    ``tensors``, ``metadata``), which ``MooncakeTransfer.get_generated`` reads, and no
    ``hidden_states_path`` (speculators deletes a sample by that path first, and
    Mooncake knows the object only by its handle).
    """
    params = {
        "hidden_states_path": hidden_states_path(extraction.uri),
        "handle": extraction.key,
        "key": extraction.key,
        "uri": extraction.uri,
        "num_tokens": extraction.num_tokens,
        "shape": list(extraction.shape),
        "bytes": extraction.size,
        "sha256": extraction.sha256,
        "codec": extraction.codec,
        "num_loss_tokens": extraction.num_loss_tokens,
    }
    if extraction.data is not None:
        params["data"] = base64.b64encode(extraction.data).decode()
    if extraction.transfer is not None:
        del params["hidden_states_path"]
        params.update(extraction.transfer.model_dump())
    return params


def top_level_params(params: dict[str, Any]) -> dict[str, Any]:
    """The answer's top-level ``kv_transfer_params``: the first object's (vLLM's place
    for them), without an inline object's ``data``, which its choice carries already:
    the answer holds each object's bytes once."""
    return {name: value for name, value in params.items() if name != "data"}


def finish_reason(extraction: Any, max_tokens: int) -> str:
    """``length`` when generation stopped at ``max_tokens``, else ``stop`` (EOS)."""
    return "length" if len(extraction.output_token_ids) >= max_tokens else "stop"
