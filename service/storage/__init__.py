"""Pluggable object storage, chosen by URL scheme.

``open_backend(settings)`` looks the URL's scheme up in a small registry of lazily
imported backends (so boto3 is only imported when an ``s3://`` URL is used).
``open_storage(settings, observer)`` is what the service uses, in the API process and
in the engine's worker: the backend (or a factory's) wrapped in the one metrics
decorator, :class:`~service.storage.instrumented.InstrumentedStorage`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from service.storage.base import (
    AlreadyExistsError,
    Data,
    IntegrityError,
    InvalidKeyError,
    NotFoundError,
    ObjectInfo,
    ObjectPage,
    ObjectReader,
    ObjectRef,
    Storage,
    StorageConfigError,
    StorageError,
    StorageFullError,
    StorageObserver,
    StorageOp,
    StorageUnavailableError,
    Swept,
)

if TYPE_CHECKING:
    from service.config import StorageSettings

BackendFactory = Callable[["StorageSettings"], Storage]

# scheme -> "module:Class"; each class has from_settings(url, settings).
BACKENDS: dict[str, str] = {
    "file": "service.storage.local:LocalStorage",
    "s3": "service.storage.s3:S3Storage",
    "mooncake": "service.storage.mooncake:MooncakeStorage",
}

__all__ = [
    "BACKENDS",
    "AlreadyExistsError",
    "Data",
    "IntegrityError",
    "InvalidKeyError",
    "NotFoundError",
    "ObjectInfo",
    "ObjectPage",
    "ObjectReader",
    "ObjectRef",
    "Storage",
    "StorageConfigError",
    "StorageError",
    "StorageFullError",
    "StorageObserver",
    "StorageOp",
    "StorageUnavailableError",
    "Swept",
    "backend_factory",
    "open_backend",
    "open_storage",
    "scheme_of",
]


def scheme_of(url: str) -> str:
    """The backend scheme of a storage URL; a plain path means ``file``."""
    scheme = urlsplit(url).scheme
    # A one-letter scheme is a Windows drive, not a URL; treat it as a path too.
    return scheme if len(scheme) > 1 else "file"


def open_backend(settings: StorageSettings) -> Storage:
    """Build the bare backend that ``settings.url`` names (no metrics).

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
    return backend


class _Discard:
    def observe(self, op: StorageOp) -> None:
        return None


def open_storage(
    settings: StorageSettings,
    observer: StorageObserver | None = None,
    *,
    factory: str | None = None,
) -> Storage:
    """The storage the service uses: the backend, instrumented, reporting to ``observer``.

    ``factory`` ("module:callable", see :func:`backend_factory`) builds the backend
    instead of :func:`open_backend`. Without an observer the calls are timed and
    dropped. Raises ValueError for an unknown scheme or a malformed URL.
    """
    from service.storage.instrumented import InstrumentedStorage

    backend = backend_factory(factory)(settings)
    return InstrumentedStorage(backend, observer if observer is not None else _Discard())


def backend_factory(path: str | None) -> BackendFactory:
    """``open_backend``, or the ``"module:callable"`` named by ``path`` (fault injection
    in tests; a custom backend in a deployment). It returns a bare backend: metrics
    are added by :func:`open_storage`."""
    if not path:
        return open_backend
    module_name, name = path.split(":")
    factory: BackendFactory = getattr(importlib.import_module(module_name), name)
    return factory
