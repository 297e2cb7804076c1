"""What an object may be called and how long it may live: the rules that settings,
request schemas and storage share.

A key is ``/``-separated segments of ``[A-Za-z0-9._=-]``, each starting with a letter
or digit, at most 255 bytes a segment and 1024 in all (``validate_key``); an object lives
at most ``MAX_TTL_S``. Storage applies these rules before it touches a store
(``service.storage.keys``, whose ``validate_key`` raises ``InvalidKeyError``); settings
check a key prefix with them. This module imports nothing of ours, so ``service.config``
needs nothing from ``service.storage``.
"""

from __future__ import annotations

import re

#: The longest TTL a request or the server default may ask for: 366 days. Longer-lived
#: objects are simply not given a TTL (the default).
MAX_TTL_S = 366 * 24 * 3600
MAX_KEY_BYTES = 1024  # S3's limit on key length
MAX_SEGMENT_BYTES = 255  # NAME_MAX on every common file system

#: One segment of a key. It starts with a letter or digit (so never "." or "..", and
#: never a hidden temp file name) and holds only characters that are safe in URLs, shells
#: and paths.
SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")


def key_problem(key: object) -> str | None:
    """Why ``key`` is not a safe relative key, or None if it is one.

    Safe means: ``/``-separated segments of ``[A-Za-z0-9._=-]`` each starting with a
    letter or digit, no empty segment, at most 255 bytes a segment and 1024 in all.
    That rules out ``..``, absolute paths, NUL, backslashes and hidden names.
    """
    if not isinstance(key, str) or not key:
        return "key must be a non-empty string"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"key is longer than {MAX_KEY_BYTES} bytes"
    for segment in key.split("/"):
        if len(segment) > MAX_SEGMENT_BYTES:
            return "key segment is longer than 255 bytes"
        if not SEGMENT.fullmatch(segment):
            return f"key segment {segment[:64]!r} is not allowed"
    return None


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key (``key_problem``), else raise
    ValueError saying why."""
    problem = key_problem(key)
    if problem is not None:
        raise ValueError(problem)
    return key
