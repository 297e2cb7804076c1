"""One JSON error shape: ``{"error": {"type", "message", "field"?, "index"?}}``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.schemas import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error the client sees as ``status`` with the shared body."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        field: str | None = None,
        index: int | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers, self.extra = status, headers, extra or {}
        self.detail = ErrorDetail(type=type, message=message, field=field, index=index)

    def response(self) -> JSONResponse:
        body = ErrorBody(error=self.detail).model_dump(exclude_none=True) | self.extra
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class BodyError(StarletteHTTPException):
    """An ApiError raised while a request body is read (``service.api.body_limit``).

    An HTTPException, so FastAPI re-raises it while parsing instead of making it a 400;
    it carries the ApiError the client sees. It lives here, beside its handler, so that
    this module needs nothing from the middleware that raises it.
    """

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.status, str(error))
        self.error = error


def limit_error(field: str, message: str, *, index: int | None = None) -> ApiError:
    """A 422 ``limit_exceeded`` naming ``field`` (and the prompt at ``index``)."""
    return ApiError(422, "limit_exceeded", f"{field}: {message}", field=field, index=index)


#: Error types that only say "this union branch does not apply": never the best error.
_BRANCH_MISMATCH = {"string_type", "model_type", "dict_type", "model_attributes_type"}


def _best_error(errors: Sequence[Any]) -> Any:
    """The error to report: for ``str | PromptObject``, the branch the input was meant for."""
    specific = [e for e in errors if e.get("type") not in _BRANCH_MISMATCH]
    return (specific or list(errors))[0]


def _field_and_index(loc: tuple[Any, ...]) -> tuple[str | None, int | None]:
    """``("body", "prompts", 3, "PromptObject", "text")`` -> ``("prompts[3].text", 3)``."""
    parts = [p for p in loc if p != "body"]
    index = None
    if len(parts) > 1 and parts[0] == "prompts" and isinstance(parts[1], int):
        index = parts[1]
        del parts[2:3]  # the union branch pydantic tried ("constrained-str", "PromptObject")
    field = ""
    for part in parts:
        field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
    return field or None, index


def _count_rejection(request: Request, kind: str) -> None:
    """Refusals of /extract that happen before its handler runs (parsing, body size, auth)."""
    metrics = getattr(getattr(request.app.state, "hsx", None), "metrics", None)
    if metrics is not None and request.url.path == "/extract":
        metrics.rejected(kind)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = _best_error(exc.errors())
    if first.get("type") == "json_invalid":  # FastAPI puts the byte offset in "loc"
        position = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        message = f"body: not valid JSON: {reason} (at byte {position})"
        field: str | None = "body"
        index = None
    else:
        field, index = _field_and_index(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        message = f"{field}: {message}" if field else message
    _count_rejection(request, "invalid_request")
    return ApiError(422, "invalid_request", message, field=field, index=index).response()


#: Why a body that json.loads refused could not be parsed (FastAPI only says 400).
_PARSE_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (UnicodeDecodeError, "not valid UTF-8"),
    (RecursionError, "JSON nested too deeply"),
    (ValueError, "a number is too long (integers may have at most 4300 digits)"),
)


def _unparsable_body(exc: BaseException) -> ApiError | None:
    """FastAPI's 400 "error parsing the body" as our 422, saying what was wrong."""
    cause = exc.__cause__
    if cause is None:
        return None
    reason = next((why for cls, why in _PARSE_FAILURES if isinstance(cause, cls)), None)
    message = f"body: {reason or 'not valid JSON'}"
    return ApiError(422, "invalid_request", message, field="body")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyError):
        _count_rejection(request, exc.error.detail.type)
        return exc.error.response()
    parse_error = _unparsable_body(exc) if exc.status_code == 400 else None
    if parse_error is not None:
        _count_rejection(request, "invalid_request")
        return parse_error.response()
    kind = {
        401: "unauthorized",
        404: "not_found",
        405: "method_not_allowed",
        413: "payload_too_large",
    }.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    field = "body" if exc.status_code == 413 else None
    if exc.status_code < 500:
        _count_rejection(request, kind)
    return ApiError(exc.status_code, kind, str(exc.detail), headers=headers, field=field).response()


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _storage_error(_: Request, exc: Exception) -> JSONResponse:
    from service.storage.base import StorageFullError, StorageUnavailableError

    # The detail (paths, bucket, endpoint) goes to the log, never to the client.
    log.warning("hsx: storage error: %s", exc)
    if isinstance(exc, StorageFullError):
        return ApiError(507, "storage_full", "storage: the store is full").response()
    if isinstance(exc, StorageUnavailableError):
        return ApiError(503, "storage_error", "storage: unavailable; retry later").response()
    return ApiError(502, "storage_error", "storage: the operation failed").response()


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # Logged with its traceback by uvicorn (Starlette re-raises after answering).
    return ApiError(500, "internal_error", "internal error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the shared shape."""
    from service.storage.base import StorageError

    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StorageError, _storage_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
