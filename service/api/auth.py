"""API keys: ``Authorization: Bearer <key>``, each key mapped to a namespace.

Keys come from a file (``namespace:key`` per line, ``#`` comments on their own lines)
and optionally from ``HSX_SERVER__API_KEYS`` (same pairs, comma-separated). Several keys
may map to one namespace, so a key is rotated by adding the new one, moving clients,
removing the old; one key may not appear twice. Only SHA-256 digests are kept, and every
lookup compares against every digest with ``hmac.compare_digest``, so timing says
nothing about which key nearly matched.

``AuthMiddleware`` checks the key from the request's headers before anything else:
before the body is read, before routing. An unauthenticated request costs the parse of
its head and one hash.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import ApiError
from service.storage.keys import validate_namespace

log = logging.getLogger(__name__)

#: The namespace of every caller when no keys are configured.
OPEN_NAMESPACE = "default"
#: Where ``AuthMiddleware`` leaves the caller's namespace in the ASGI scope.
SCOPE_NAMESPACE = "hsx.namespace"
#: RFC 6750's b64token: what a Bearer credential may be made of.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class ApiKeys:
    """The configured keys; ``namespace_for(token)`` is the only question asked."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._digests = [(_digest(key), namespace) for namespace, key in pairs]

    @classmethod
    def load(cls, path: Path | None, inline: str | None = None) -> ApiKeys:
        """Read keys from ``path`` and ``inline``; raises ValueError naming the bad line.

        Refused: a line that is not ``namespace:key``, a key outside RFC 6750's token
        characters (an inline ``# comment`` would otherwise become part of the key), a
        key shorter than 16 characters, and a key that appears twice.
        """
        pairs: list[tuple[str, str]] = []
        seen: dict[str, str] = {}
        entries: list[tuple[str, str]] = []
        if path is not None:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                line = line.strip()
                if line and not line.startswith("#"):
                    entries.append((line, f"{path}:{number}"))
        for number, item in enumerate((inline or "").split(","), 1):
            if item.strip():
                entries.append((item.strip(), f"HSX_SERVER__API_KEYS item {number}"))
        for text, where in entries:
            namespace, key = _pair(text, where)
            digest = _digest(key).hex()
            if digest in seen:
                raise ValueError(f"{where}: this key already appears at {seen[digest]}")
            seen[digest] = where
            pairs.append((namespace, key))
        return cls(pairs)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def count(self) -> int:
        return len(self._digests)

    @property
    def namespaces(self) -> frozenset[str]:
        """The namespaces the keys name (several keys may share one: rotation)."""
        return frozenset(namespace for _, namespace in self._digests)

    def namespace_for(self, token: str) -> str | None:
        """The namespace of ``token``, or None. Constant time in the matched key."""
        digest = _digest(token)
        found = None
        for known, namespace in self._digests:
            if hmac.compare_digest(known, digest) and found is None:
                found = namespace
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _pair(text: str, where: str) -> tuple[str, str]:
    namespace, sep, key = text.partition(":")
    namespace, key = namespace.strip(), key.strip()
    if not sep or not key:
        raise ValueError(f"{where}: expected 'namespace:key'")
    if "#" in key and any(c.isspace() for c in key):
        raise ValueError(f"{where}: inline comments are not allowed; put '# ...' on its own line")
    if not _TOKEN.fullmatch(key):
        raise ValueError(
            f"{where}: a key may hold only letters, digits and -._~+/ (then '=' padding)"
        )
    if len(key) < 16:
        raise ValueError(f"{where}: key is shorter than 16 characters")
    try:
        validate_namespace(namespace)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return namespace, key


class AuthMiddleware:
    """401 for a request without a valid key, from its headers alone, before anything else.

    Every path outside ``public`` needs a key, whether or not a route serves it, so new
    routes are covered without a word and unknown paths cannot be enumerated. The
    caller's namespace goes into the scope (``SCOPE_NAMESPACE``) for the routes.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        public: frozenset[str],
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.app, self.keys, self.public = app, keys, public
        self.on_refused = on_refused  # called with the path of each refused request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # none served; refuse before any handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        if not self.keys.enabled:
            scope[SCOPE_NAMESPACE] = OPEN_NAMESPACE
            await self.app(scope, receive, send)
            return
        token, reason = bearer_token(scope["headers"])
        namespace = self.keys.namespace_for(token) if token is not None else None
        if namespace is None:
            message = f"{reason or 'invalid API key'}: send 'Authorization: Bearer <key>'"
            error = ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})
            if self.on_refused is not None:
                self.on_refused(scope["path"])
            await error.response()(scope, receive, send)
            return
        scope[SCOPE_NAMESPACE] = namespace
        await self.app(scope, receive, send)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """The Bearer token of ``headers``, or None and why not."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if not values:
        return None, "missing API key"
    if len(values) > 1:
        return None, "more than one Authorization header"
    scheme, _, token = values[0].decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None, "not a Bearer key"
    return token.strip(), None
