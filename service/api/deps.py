"""Dependencies of the route handlers: the shared state and the caller's namespace."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.api.auth import OPEN_NAMESPACE
from service.api.errors import ApiError
from service.api.state import ApiState

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer <key>`")


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.hsx
    return state


StateDep = Annotated[ApiState, Depends(get_state)]


def caller_namespace(
    state: StateDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The namespace of the caller's key; 401 without a valid one (when keys exist)."""
    if not state.keys.enabled:
        return OPEN_NAMESPACE
    namespace = state.keys.namespace_for(credentials.credentials) if credentials else None
    if namespace is None:
        reason = "missing API key" if credentials is None else "invalid API key"
        raise ApiError(
            401,
            "unauthorized",
            f"{reason}: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return namespace


NamespaceDep = Annotated[str, Depends(caller_namespace)]
