"""The errors every storage backend raises, in a module that imports nothing of ours.

``service.storage.keys`` raises :class:`InvalidKeyError` and ``service.storage.base``
uses the key validators, so the errors sit below both. Import them from
``service.storage`` (or, as before, ``service.storage.base``).
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "IntegrityError",
    "InvalidKeyError",
    "NotFoundError",
    "StorageConfigError",
    "StorageError",
    "StorageFullError",
    "StorageUnavailableError",
]


class StorageError(Exception):
    """A storage operation failed. ``operation`` and ``key`` say which one."""

    kind = "error"

    def __init__(self, message: str, *, operation: str = "", key: str = "") -> None:
        super().__init__(message)
        self.operation = operation
        self.key = key


class NotFoundError(StorageError):
    """No object exists under the key."""

    kind = "not_found"


class AlreadyExistsError(StorageError):
    """The key exists and the backend is create-only."""

    kind = "already_exists"


class InvalidKeyError(StorageError, ValueError):
    """The key is malformed or would resolve outside the backend's root."""

    kind = "invalid_key"


class StorageUnavailableError(StorageError):
    """The store cannot be reached (network, 5xx after retries, disk gone)."""

    kind = "unavailable"


class StorageFullError(StorageError):
    """The store has no room for the object (an in-memory store at its capacity).

    Nothing was written; the same put succeeds once something is deleted.
    """

    kind = "full"


class StorageConfigError(StorageError):
    """The store refuses us for a reason retries cannot fix: no bucket, no access."""

    kind = "config"


class IntegrityError(StorageError):
    """Bytes read back do not match the checksum recorded at write time."""

    kind = "integrity"
