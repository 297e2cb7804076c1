"""A route whose JSON body hsx parses itself, so that what a body costs is bounded first.

The per-message cost of a chat body (model validation, the chat parser, the template)
is paid before any token exists, so the bounds (``service.api.prompts``) are checked on
the JSON the client sent, before the request model validates it: an endpoint names its
check with ``body_check``. A large body is parsed, checked and validated on the
tokenizer pool, under the request's deadline, off the event loop (``service.api.pool``).
"""

from __future__ import annotations

import email.message
import functools
import json
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from service.api.errors import ApiError
from service.api.pool import in_pool, release_memory_soon, request_deadline

if TYPE_CHECKING:
    from service.api.state import ApiState

#: Bodies up to this size are parsed on the event loop (a thread hop costs more); larger
#: ones on the tokenizer pool, where the JSON parser and the model validation cannot
#: stall every other request (six 8 MB bodies once kept ``/health`` waiting 8 s).
POOL_BODY_BYTES = 64 * 1024
#: After a request with a body this large, freed heap goes back to the system.
TRIM_BODY_BYTES = 1024 * 1024

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
