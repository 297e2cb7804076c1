"""Prometheus metrics of storage: every storage call, by backend, and the whole store.

:class:`StorageMetrics` observes storage calls (a ``StorageObserver``): the API
process's own directly, the worker's as they arrive in its completion messages
(``service.engine.metrics.ExtractorMetrics``, which holds one). :class:`StoreCollector`
reads a bounded store's own totals when ``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.storage.base import Storage, StorageOp, Swept

# Storage calls range from sub-millisecond local heads to multi-second S3 multiparts.
STORAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: Storage operations, pre-registered so every series exists from the start.
OPERATIONS = ("put", "get", "head", "exists", "list", "delete", "ping")
#: Storage error kinds (``StorageError.kind`` of service.storage.base), pre-registered
#: too, so that a dashboard's error rate reads 0, not "no data", while all is well.
ERROR_KINDS = (
    "error", "not_found", "already_exists", "invalid_key", "unavailable", "config", "integrity",
    "full",
)  # fmt: skip
#: Why the sweeper removed something (``hsx_storage_swept_objects_total{reason}``).
SWEEP_REASONS = ("expired", "orphan")


class StorageMetrics:
    """Latency, bytes, errors and retries of storage calls, by backend.

    A :class:`~service.storage.base.StorageObserver`: give it to ``open_storage``.
    """

    def __init__(self, registry: CollectorRegistry, backend: str | None = None) -> None:
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
        self.retries = Counter(
            "hsx_storage_retries",
            "Retries made by storage clients (S3: botocore retry attempts).",
            ["backend"],
            registry=registry,
        )
        self.swept = Counter(
            "hsx_storage_swept_objects",
            "Files the storage sweeper removed: expired objects, and orphans (temp files "
            "and expiry records no writer or object owns).",
            ["reason"],
            registry=registry,
        )
        for reason in SWEEP_REASONS:
            self.swept.labels(reason)
        if backend is not None:
            for operation in OPERATIONS:
                self.duration.labels(backend, operation)
                for kind in ERROR_KINDS:
                    self.errors.labels(backend, operation, kind)
            for counter in (self.written, self.read, self.retries):
                counter.labels(backend)

    def record_sweep(self, swept: Swept) -> None:
        """Count what one sweep removed."""
        self.swept.labels("expired").inc(swept.expired)
        self.swept.labels("orphan").inc(swept.orphan)

    def observe(self, op: StorageOp) -> None:
        """Record one storage call."""
        self.duration.labels(op.backend, op.operation).observe(op.seconds)
        if op.written:
            self.written.labels(op.backend).inc(op.written)
        if op.read:
            self.read.labels(op.backend).inc(op.read)
        if op.error is not None:
            self.errors.labels(op.backend, op.operation, op.error).inc()
        if op.retries:
            self.retries.labels(op.backend).inc(op.retries)


class StoreCollector(Collector):
    """The whole store's bytes, capacity, objects and evictions, for a bounded store
    (Mooncake: read from its master's metrics, ``Storage.usage``); nothing for disks and
    buckets. Collected off the event loop (the ``/metrics`` route renders in a thread)."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    def collect(self) -> Iterable[Metric]:
        usage = self._storage.usage()
        if usage is None:
            return
        backend = self._storage.scheme
        for name, text, value in (
            ("hsx_storage_store_bytes", "Bytes the whole store holds.", usage.bytes),
            (
                "hsx_storage_store_capacity_bytes",
                "Bytes the store's members contribute; a full store refuses writes (507).",
                usage.capacity_bytes,
            ),
            ("hsx_storage_store_objects", "Objects the whole store holds.", usage.objects),
        ):
            gauge = GaugeMetricFamily(name, text, labels=["backend"])
            gauge.add_metric([backend], value)
            yield gauge
        evictions = CounterMetricFamily(
            "hsx_storage_store_evictions",
            "Objects the store itself evicted (hsx pins its objects: this stays 0 "
            "unless another writer shares the store).",
            labels=["backend"],
        )
        evictions.add_metric([backend], usage.evicted_objects)
        yield evictions
