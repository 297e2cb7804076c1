"""What the two clients share: request building, the one error, answer parsing.

httpx's shape: a request is described once (:class:`Call`: method, path, arguments and
how to read the answer) by :class:`BaseHsxClient`, and ``HsxClient`` sends it with
``httpx.Client`` while ``AsyncHsxClient`` awaits it with ``httpx.AsyncClient``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from service.client.models import ExtractResponse, ModelList, Tokenized, Version

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
#: Text, token ids, or an object with one of ``text``, ``token_ids``, ``messages``.
Prompt = str | Sequence[int] | Mapping[str, Any]

#: Fields of each ``objects[]`` entry checked one by one, so a bad answer names the field.
OBJECT_FIELDS: dict[str, type] = {
    "index": int,
    "key": str,
    "num_tokens": int,
    "bytes": int,
    "sha256": str,
}


class HsxError(Exception):
    """hsx answered with an error: its ``status``, the error body's ``type``, ``message``
    and ``index`` (the prompt at fault, when one is), and ``Retry-After`` in seconds."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        index: int | None = None,
        retry_after: float | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message = status, type, message
        self.index, self.retry_after, self.body = index, retry_after, body


class BadResponseError(HsxError):
    """A success status whose body is not the answer hsx gives (a proxy's page, a
    truncated body): the server may be fine, what stands in front of it is not."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, "bad_response", message)


@dataclass(frozen=True)
class ExtractOptions:
    """The fields of ``POST /extract`` besides the prompts; ``None`` means the server's
    default (codec, all its layers, no loss mask) and is not sent."""

    max_tokens: int = 1
    include_output_tokens: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict)
    loss: str | None = None
    codec: str | None = None
    layers: Sequence[int] | None = None
    #: ``"last"``, ``"mean"``, ``"mean_loss"`` or ``{"start": s, "end": e}``; None: all.
    tokens: str | Mapping[str, int] | None = None
    #: ``return: inline``: the objects come back in the answer (``StoredObject.tensors``)
    #: and nothing is stored.
    inline: bool = False
    #: ``regenerate``: ``{}`` (greedy defaults) or sampling settings; None: not sent.
    regenerate: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to send, and how to read its (successful) answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    kwargs: dict[str, Any] = field(default_factory=dict)


class BaseHsxClient:
    """Configuration and request building shared by the sync and async clients.

    ``api_key`` goes as ``Authorization: Bearer``; httpx drops it when a redirect leaves
    the server's origin (the presigned S3 URL of ``GET /objects/{key}``).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = 600.0,
        max_connections: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._options: dict[str, Any] = {
            "base_url": self.base_url,
            "headers": auth_headers(api_key),
            "timeout": timeout,
            "follow_redirects": True,
        }
        if max_connections is not None:
            self._options["limits"] = httpx.Limits(max_connections=max_connections)

    def _extract(self, body: bytes, count: int) -> Call[ExtractResponse]:
        headers = {"Content-Type": "application/json"}
        kwargs = {"content": body, "headers": headers}
        return Call("POST", "/extract", lambda r: decode_extract(r, count), kwargs)

    def _models(self) -> Call[ModelList]:
        return Call("GET", "/v1/models", lambda r: parse(r, ModelList))

    def _version(self) -> Call[Version]:
        return Call("GET", "/version", lambda r: parse(r, Version))

    def _tokenize(self, model: str, prompt: Mapping[str, Any]) -> Call[Tokenized]:
        body = tokenize_body(model, prompt)
        return Call("POST", "/tokenize", lambda r: parse(r, Tokenized), {"json": body})

    def _metrics(self) -> Call[str]:
        return Call("GET", "/metrics", lambda r: r.text)

    def _get_object(self, key: str) -> Call[bytes]:
        return Call("GET", f"/objects/{key}", lambda r: r.content)

    def _delete(self, key: str) -> Call[None]:
        return Call("DELETE", f"/objects/{key}", lambda r: None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header of ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def finish(call: Call[T], response: httpx.Response) -> T:
    """The parsed answer, or the :class:`HsxError` an error answer stands for."""
    if not response.is_success:
        raise error_from(response)
    return call.parse(response)


def encode_extract(prompts: Sequence[Prompt], options: ExtractOptions) -> bytes:
    """The ``POST /extract`` body as bytes: UTF-8 JSON, as httpx's ``json=`` sends it.

    Raises ValueError (a lone surrogate, a NaN) or TypeError (a value JSON cannot hold)
    before anything is sent.
    """
    body: dict[str, Any] = {
        "prompts": [_prompt(p) for p in prompts],
        "max_tokens": options.max_tokens,
        "include_output_tokens": options.include_output_tokens,
    }
    if options.metadata:
        body["metadata"] = dict(options.metadata)
    for name in ("loss", "codec", "layers"):
        value = getattr(options, name)
        if value is not None:  # only when asked: servers without codecs still work
            body[name] = list(value) if name == "layers" else value
    if options.tokens is not None:
        body["tokens"] = options.tokens if isinstance(options.tokens, str) else dict(options.tokens)
    if options.inline:
        body["return"] = "inline"
    if options.regenerate is not None:
        body["regenerate"] = dict(options.regenerate)
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode()


def tokenize_body(model: str, prompt: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``/tokenize`` request for a prompt object (text or messages)."""
    body: dict[str, Any] = {"model": model}
    if "messages" in prompt:
        body["messages"] = prompt["messages"]
        body["add_generation_prompt"] = prompt["messages"][-1]["role"] != "assistant"
    else:
        body["prompt"] = prompt["text"]
    return body


def _prompt(prompt: Prompt) -> Any:
    if isinstance(prompt, str | Mapping):
        return prompt
    return {"token_ids": list(prompt)}


def error_from(response: httpx.Response) -> HsxError:
    """The :class:`HsxError` of an error answer; hsx's body is ``{"error": {...}}``, and
    anything else (a proxy's page) keeps its first 200 characters as the message."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        kind, message = str(error.get("type", "error")), str(error.get("message", ""))
        index = error.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) else None
    else:
        kind, index = "error", None
        message = (body if isinstance(body, str) else json.dumps(body))[:200]
    return HsxError(response.status_code, kind, message, index, retry_after(response), body)


def retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (the delay form), or None."""
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def parse(response: httpx.Response, model: type[M]) -> M:
    """The answer as ``model``; :class:`BadResponseError` when it is not one."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise BadResponseError(response.status_code, _what(response, exc)) from None


def _what(response: httpx.Response, exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{response.status_code} that is not hsx's answer ({where or 'body'}: {error['msg']})"


def decode_extract(response: httpx.Response, count: int) -> ExtractResponse:
    """A ``POST /extract`` answer for ``count`` prompts, checked whole before any of it
    is used: the objects first (each field by name, each index one of the prompts),
    then the rest of the body. Raises :class:`BadResponseError`."""
    status = response.status_code
    kind = response.headers.get("content-type", "no content type")
    try:
        body = response.json()
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        sample = response.text[:80] if response.content else ""
        raise BadResponseError(
            status, f"{status} with a body that is not JSON ({kind}): {sample!r}"
        ) from None
    objects = body.get("objects") if isinstance(body, dict) else None
    if not isinstance(objects, list):
        raise BadResponseError(
            status, f"{status} without an objects list ({kind}): {json.dumps(body)[:80]}"
        )
    for number, obj in enumerate(objects):
        _check_object(status, number, obj, count)
    if count and not objects:
        raise BadResponseError(status, f"{status} without any of the {count} prompts' objects")
    try:
        return ExtractResponse.model_validate(body)
    except ValidationError as exc:
        raise BadResponseError(status, _what(response, exc)) from None


def _check_object(status: int, number: int, obj: Any, count: int) -> None:
    if not isinstance(obj, dict):
        raise BadResponseError(status, f"objects[{number}] is not an object")
    for name, kinds in OBJECT_FIELDS.items():
        value = obj.get(name)
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise BadResponseError(
                status, f"objects[{number}].{name} is missing or not {kinds.__name__}"
            )
    loss = obj.get("num_loss_tokens")
    if loss is not None and (not isinstance(loss, int) or isinstance(loss, bool)):
        raise BadResponseError(status, f"objects[{number}].num_loss_tokens is not int")
    if not 0 <= obj["index"] < count:
        raise BadResponseError(status, f"objects[{number}].index {obj['index']} is not a prompt's")
