"""Prometheus metrics of hsx (prefix ``hsx_``).

Metric objects are built per app on a registry the caller passes (the process default
in production, where vLLM's own ``vllm:*`` metrics already live; a fresh one in tests),
never at import time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from service.storage.base import Storage

# Storage calls range from sub-millisecond local heads to multi-second S3 multiparts.
STORAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _RetryCollector(Collector):
    """Exposes the retries each live backend's client has made, read at scrape time."""

    def __init__(self) -> None:
        self._backends: list[Storage] = []
        self._lock = threading.Lock()

    def add(self, backend: Storage) -> None:
        with self._lock:
            self._backends.append(backend)

    def remove(self, backend: Storage) -> None:
        with self._lock:
            if backend in self._backends:
                self._backends.remove(backend)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "hsx_storage_retries",
            "Retries made by storage clients (S3: botocore retry attempts).",
            labels=["backend"],
        )
        totals: dict[str, int] = {}
        with self._lock:
            for backend in self._backends:
                totals[backend.scheme] = totals.get(backend.scheme, 0) + backend.retries
        for scheme, total in sorted(totals.items()):
            family.add_metric([scheme], total)
        yield family


class StorageMetrics:
    """Latency, bytes, errors and retries of storage operations, by backend."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.duration = Histogram(
            "hsx_storage_operation_duration_seconds",
            "Duration of storage operations, errors included.",
            ["backend", "operation"],
            buckets=STORAGE_BUCKETS,
            registry=registry,
        )
        self.written = Counter(
            "hsx_storage_written_bytes",
            "Bytes published to storage.",
            ["backend"],
            registry=registry,
        )
        self.read = Counter(
            "hsx_storage_read_bytes",
            "Bytes read back from storage.",
            ["backend"],
            registry=registry,
        )
        self.errors = Counter(
            "hsx_storage_errors",
            "Failed storage operations, by operation and error kind.",
            ["backend", "operation", "kind"],
            registry=registry,
        )
        self.retries = _RetryCollector()
        registry.register(self.retries)
