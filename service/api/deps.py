"""Dependencies of the route handlers: the shared state and the caller's namespace."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.api.auth import SCOPE_NAMESPACE
from service.api.errors import ApiError
from service.api.state import ApiState

# Declares the scheme in the OpenAPI document; the key itself is checked earlier, by
# service.api.auth.AuthMiddleware, before the body is read.
_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer <key>`")


# Both dependencies are ``async def`` although they never await: FastAPI runs a plain
# ``def`` dependency in its thread pool, and two thread hops per request cost the event
# loop more than everything these functions do.


async def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.hsx
    return state


StateDep = Annotated[ApiState, Depends(get_state)]


async def caller_namespace(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The namespace AuthMiddleware found for the caller's key."""
    namespace = request.scope.get(SCOPE_NAMESPACE)
    if not isinstance(namespace, str):  # only reachable if the middleware was left out
        raise ApiError(
            401, "unauthorized", "missing API key", headers={"WWW-Authenticate": "Bearer"}
        )
    return namespace


NamespaceDep = Annotated[str, Depends(caller_namespace)]
