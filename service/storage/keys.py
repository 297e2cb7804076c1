"""Object keys: made by the server, validated everywhere.

Keys look like ``{prefix}/{namespace}/{yyyy}/{mm}/{dd}/{id}.safetensors``. The namespace
comes from the caller's identity (its API key), the id is random and made here, so no
client string ever becomes a key or a path. Idempotent prompts (a ``custom_id``) get
``{prefix}/{namespace}/by-id/{hh}/{sha256}.safetensors`` instead: a hash of the
namespace, the served model and the custom_id, with no date, so a retry on any day
finds it.
``validate_key`` is the one gate every backend applies before touching the store.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from service.keyspace import MAX_KEY_BYTES as MAX_KEY_BYTES
from service.keyspace import MAX_SEGMENT_BYTES, SEGMENT, key_problem
from service.storage.errors import InvalidKeyError

OBJECT_SUFFIX = ".safetensors"
BY_ID = "by-id"  # the segment of idempotent keys where dated keys have the year

_NAMESPACE = re.compile(r"[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?")


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidKeyError.

    Safe means: ``/``-separated segments of ``[A-Za-z0-9._=-]`` each starting with a
    letter or digit, no empty segment, at most 255 bytes a segment and 1024 in all.
    That rules out ``..``, absolute paths, NUL, backslashes and hidden names
    (``service.keyspace``, the rules settings share).
    """
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(problem, key=key[:64] if isinstance(key, str) else str(key))
    return key


def is_segment(name: str) -> bool:
    """Whether ``name`` can be one ``/``-separated segment of a key."""
    return len(name.encode("utf-8", "surrogatepass")) <= MAX_SEGMENT_BYTES and bool(
        SEGMENT.fullmatch(name)
    )


def is_key(key: str) -> bool:
    """Whether ``validate_key`` accepts ``key``: what a listing may return."""
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


def validate_key_prefix(prefix: str) -> str:
    """Return ``prefix`` if some valid key could start with it, else raise InvalidKeyError.

    Empty, or ``/``-separated segments as in keys, the last of which may be partial or
    empty (``"hsx/team-a/"``, ``"hsx/team-a/2026/1"``).
    """
    if not isinstance(prefix, str):
        raise InvalidKeyError("prefix must be a string", key=str(prefix))
    if not prefix:
        return prefix
    if prefix.startswith("/"):
        raise InvalidKeyError("prefix must be relative", key=prefix[:64])
    head, _, last = prefix.rpartition("/")
    if head:
        validate_key(head)
    if last and not SEGMENT.fullmatch(last):
        raise InvalidKeyError(f"prefix segment {last[:64]!r} is not allowed", key=prefix[:64])
    if len(prefix.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"prefix is longer than {MAX_KEY_BYTES} bytes", key=prefix[:64])
    return prefix


def validate_namespace(namespace: str) -> str:
    """Return ``namespace`` if valid: 1-64 of ``[a-z0-9_-]``, alphanumeric at both ends."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"namespace {str(namespace)[:64]!r} must be 1-64 characters of [a-z0-9_-], "
            "starting and ending with a letter or digit"
        )
    return namespace


def new_object_key(prefix: str, namespace: str, *, now: datetime | None = None) -> str:
    """Make a fresh key for one object of ``namespace``: prefix/ns/yyyy/mm/dd/id.safetensors."""
    validate_namespace(namespace)
    when = (now or datetime.now(UTC)).astimezone(UTC)
    object_id = uuid.uuid4().hex
    parts = [prefix] if prefix else []
    parts += [namespace, f"{when:%Y}", f"{when:%m}", f"{when:%d}", object_id + OBJECT_SUFFIX]
    return validate_key("/".join(parts))


def idempotent_key(
    prefix: str,
    namespace: str,
    *,
    custom_id: str,
    model: str,
    layer_ids: Sequence[int],
    dtype: str,
) -> str:
    """The key of the prompt ``custom_id`` names in ``namespace`` on this served model.

    A SHA-256 over the namespace, the served model, its layer ids and dtype, and the
    custom_id: what the prompt is (its token ids) and how it is stored (codec, layers,
    loss, generated tokens, metadata) are not part of it, so one custom_id has one key
    whatever a request sends, and a request that differs from the stored object's is
    told so (``service.api.idempotency``) instead of making a second object. The
    client's string only ever enters the hash.
    """
    validate_namespace(namespace)
    identity = {
        "v": 2,
        "namespace": namespace,
        "model": model,
        "layer_ids": list(layer_ids),
        "dtype": dtype,
        "custom_id": custom_id,
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    parts = [prefix] if prefix else []
    # Two hex digits spread the objects over 256 directories on local disk.
    parts += [namespace, BY_ID, digest[:2], digest + OBJECT_SUFFIX]
    return validate_key("/".join(parts))


def is_idempotent_key(key: str) -> bool:
    """Whether ``key`` was made by ``idempotent_key`` (``.../{namespace}/by-id/hh/...``)."""
    parts = key.split("/")
    return len(parts) >= 4 and parts[-3] == BY_ID


def namespace_root(prefix: str, namespace: str) -> str:
    """The key prefix every object of ``namespace`` starts with (``hsx/team-a/``)."""
    validate_namespace(namespace)
    return f"{prefix}/{namespace}/" if prefix else f"{namespace}/"


def namespace_of(key: str, prefix: str) -> str | None:
    """The namespace a valid key of ours belongs to, or None if it is not one of ours."""
    try:
        validate_key(key)
    except InvalidKeyError:
        return None
    parts = key.split("/")
    if prefix:
        if parts[: len(prefix.split("/"))] != prefix.split("/"):
            return None
        parts = parts[len(prefix.split("/")) :]
    dated = len(parts) == 5
    by_id = len(parts) == 4 and parts[1] == BY_ID
    if not (dated or by_id) or not parts[-1].endswith(OBJECT_SUFFIX):
        return None
    return parts[0] if _NAMESPACE.fullmatch(parts[0]) else None
