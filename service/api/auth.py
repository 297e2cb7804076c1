"""API keys: ``Authorization: Bearer <key>``, each key mapped to a namespace.

Keys come from a file (``namespace:key`` per line, ``#`` comments) and optionally from
``HSX_SERVER__API_KEYS`` (same pairs, comma-separated). Several keys may map to one
namespace, so a key is rotated by adding the new one, moving clients, removing the old.
Only SHA-256 digests are kept, and every lookup compares against every digest with
``hmac.compare_digest``, so timing says nothing about which key nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from service.storage.keys import validate_namespace

log = logging.getLogger(__name__)

#: The namespace of every caller when no keys are configured.
OPEN_NAMESPACE = "default"


class ApiKeys:
    """The configured keys; ``namespace_for(token)`` is the only question asked."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._digests = [(_digest(key), namespace) for namespace, key in pairs]

    @classmethod
    def load(cls, path: Path | None, inline: str | None = None) -> ApiKeys:
        """Read keys from ``path`` and ``inline``; raises ValueError naming the bad line."""
        pairs: list[tuple[str, str]] = []
        if path is not None:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                line = line.strip()
                if line and not line.startswith("#"):
                    pairs.append(_pair(line, f"{path}:{number}"))
        for number, item in enumerate((inline or "").split(","), 1):
            if item.strip():
                pairs.append(_pair(item.strip(), f"HSX_SERVER__API_KEYS item {number}"))
        return cls(pairs)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def count(self) -> int:
        return len(self._digests)

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
    if len(key) < 16:
        raise ValueError(f"{where}: key is shorter than 16 characters")
    try:
        validate_namespace(namespace)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return namespace, key
