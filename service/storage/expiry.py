"""When objects expire: the bounds of a TTL and how an expiry is written down.

An object's expiry is an absolute time, whole UTC unix seconds, fixed when it is
published (``put(..., expires_at=)``) and kept beside the object by the backend that
holds it (local disk: a sidecar file; S3: object tags and user metadata, see the
backends). Reads and listings treat an object whose expiry has passed as gone at once;
the bytes go later (the local sweeper, an S3 lifecycle rule). The longest TTL,
``MAX_TTL_S``, is one of the rules settings and schemas share (``service.keyspace``).
"""

from __future__ import annotations

import math
import time

from service.keyspace import MAX_TTL_S

__all__ = ["EXPIRES_AT_TAG", "MAX_TTL_S", "TTL_DAYS_TAG", "expires_at", "is_expired", "ttl_days"]

#: S3 object tag (and user-metadata key) holding the expiry, unix seconds.
EXPIRES_AT_TAG = "hsx-expires-at"
#: S3 object tag holding the TTL rounded up to whole days: what bucket lifecycle rules
#: filter on, since they expire by age in days, not at a given time.
TTL_DAYS_TAG = "hsx-ttl-days"


def expires_at(ttl_s: int | None, now: float | None = None) -> int | None:
    """The expiry of an object published now with ``ttl_s`` (None: never)."""
    if ttl_s is None:
        return None
    return math.ceil(time.time() if now is None else now) + ttl_s


def is_expired(expires: int | None, now: float | None = None) -> bool:
    """Whether an object with expiry ``expires`` is gone at ``now`` (default: now)."""
    return expires is not None and expires <= (time.time() if now is None else now)


def ttl_days(expires: int, now: float | None = None) -> int:
    """Whole days, rounded up and at least 1, from ``now`` to ``expires``: the lifecycle
    class (``hsx-ttl-days``) of an object, which S3 deletes that many days after it
    was created (so never before its expiry)."""
    remaining = expires - (time.time() if now is None else now)
    return max(1, math.ceil(remaining / 86400))
