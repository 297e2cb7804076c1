"""Pluggable object storage, chosen by URL scheme.

``open_storage(settings)`` looks the URL's scheme up in a small registry of lazily
imported backends (so boto3 is only imported when an ``s3://`` URL is used) and wraps
the backend in :class:`InstrumentedStorage` when metrics are given.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from service.storage.base import (
    AlreadyExistsError,
    IntegrityError,
    InvalidKeyError,
    NotFoundError,
    ObjectRef,
    Storage,
    StorageConfigError,
    StorageError,
    StorageUnavailableError,
)

if TYPE_CHECKING:
    from service.config import StorageSettings
    from service.metrics import StorageMetrics

# scheme -> "module:Class"; each class has from_settings(url, settings).
BACKENDS: dict[str, str] = {
    "file": "service.storage.local:LocalStorage",
    "s3": "service.storage.s3:S3Storage",
}

__all__ = [
    "BACKENDS",
    "AlreadyExistsError",
    "IntegrityError",
    "InvalidKeyError",
    "NotFoundError",
    "ObjectRef",
    "Storage",
    "StorageConfigError",
    "StorageError",
    "StorageUnavailableError",
    "open_storage",
    "scheme_of",
    "storage_factory",
]


def scheme_of(url: str) -> str:
    """The backend scheme of a storage URL; a plain path means ``file``."""
    scheme = urlsplit(url).scheme
    # A one-letter scheme is a Windows drive, not a URL; treat it as a path too.
    return scheme if len(scheme) > 1 else "file"


def open_storage(settings: StorageSettings, metrics: StorageMetrics | None = None) -> Storage:
    """Build the backend that ``settings.url`` names, instrumented if ``metrics`` given.

    Raises ValueError for an unknown scheme or a malformed URL.
    """
    scheme = scheme_of(settings.url)
    target = BACKENDS.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in sorted(BACKENDS))
        raise ValueError(f"storage URL scheme {scheme!r} is not supported; use one of {known}")
    module_name, class_name = target.split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    backend: Storage = backend_cls.from_settings(settings.url, settings)
    if metrics is None:
        return backend
    from service.storage.instrumented import InstrumentedStorage

    return InstrumentedStorage(backend, metrics)


def storage_factory(path: str | None) -> Callable[[StorageSettings], Storage]:
    """``open_storage``, or the ``"module:callable"`` named by ``path`` (fault injection
    in tests; a custom backend in a deployment)."""
    if not path:
        return open_storage
    module_name, name = path.split(":")
    factory: Callable[[StorageSettings], Storage] = getattr(
        importlib.import_module(module_name), name
    )
    return factory
