"""Prometheus metrics of the extractor: storage calls and the worker's writer.

They are fed from two processes. The API process's own storage calls (reads, deletes,
probes) are observed directly; the worker's (writes, and their S3 retries) arrive in
the completion messages (``service.engine.wire.Completion.storage_ops``) and are
observed when each message is received, so ``/metrics`` shows all storage traffic.

Why the completion channel rather than vLLM's connector stats path
(``KVConnectorStats`` / ``build_prom_metrics``): vLLM collects connector stats only
when a model step runs (``get_kv_connector_stats`` is called from the step's KV
connector context) and ships them with that step's scheduler stats. A write that lands
after the engine went idle would not be reported until the next request arrived, so
the counters would not equal the work done; and those metrics are vLLM's own objects
in the process default registry, labelled per engine, not the ``hsx_storage_*``
families of our own registry. The completion message is sent the moment each write
ends, on a channel we already have.

Metric objects live in a private registry per :class:`ExtractorMetrics`, never at
import time; each app registers the whole set in its own registry (several apps may
share one extractor in tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.storage.base import Storage, StorageOp, Swept

if TYPE_CHECKING:
    from service.engine.wire import Completion, StoredObject

#: Why the API dropped a completion-channel message (``service.engine.completion``,
#: which imports this module's consumers; kept here so metrics import no engine code).
DROP_REASONS = ("unauthenticated", "malformed", "unknown_key")

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
#: Why stored states were refused (``hsx_extract_invalid_states_total{reason}``).
INVALID_STATES_REASONS = ("non_finite", "all_zero_layer")
#: Weight of each new object in the token-norm gauge's moving average: about the last
#: 20 objects count, so one odd prompt barely moves it and a real change shows within
#: a few dozen requests.
TOKEN_NORM_WEIGHT = 0.05


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


class ExtractorMetrics(Collector):
    """Everything the extractor reports, whichever request (or none) caused it.

    Fed by every completion message, including those of cancelled requests, so the
    storage and writer numbers equal the work done.
    """

    def __init__(self, backend: str) -> None:
        self.registry = CollectorRegistry()
        self.storage = StorageMetrics(self.registry, backend)
        self.bytes_in_flight = Gauge(
            "hsx_writer_bytes_in_flight_bytes",
            "Bytes copied out of the KV cache but not yet durable, as last reported.",
            registry=self.registry,
        )
        self.peak_bytes_in_flight = Gauge(
            "hsx_writer_bytes_in_flight_peak_bytes",
            "The most bytes the writer has held in flight since the engine started.",
            registry=self.registry,
        )
        self.invalid_states = Counter(
            "hsx_extract_invalid_states",
            "Prompts whose states failed validation and were not stored, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in INVALID_STATES_REASONS:
            self.invalid_states.labels(reason)
        self.token_norm = Gauge(
            "hsx_hidden_state_token_norm",
            "Mean L2 norm of a token's stored hidden state, per layer id: an exponential "
            f"moving average (weight {TOKEN_NORM_WEIGHT} per object, the first object sets "
            "it) of each stored object's mean token norm, from the writer's statistics. "
            "A step in it means the states changed (model, vLLM, layer ids).",
            ["model", "layer"],
            registry=self.registry,
        )
        self.channel_dropped = Counter(
            "hsx_completion_messages_dropped",
            "Completion-channel messages the API dropped, by reason: unauthenticated (no "
            "valid tag: not from this start's writer), malformed (authentic, unreadable), "
            "unknown_key (a completion nobody waits for).",
            ["reason"],
            registry=self.registry,
        )
        for reason in DROP_REASONS:
            self.channel_dropped.labels(reason)
        self._norms: dict[str, float] = {}
        self._model = ""
        self._backend = backend
        self._layers: frozenset[int] = frozenset()

    def name_model(self, name: str, layer_ids: Iterable[int] = ()) -> None:
        """The served model's name (the gauge's ``model`` label) and the layer ids it
        serves (the only ``layer`` labels the gauge takes), once they are known."""
        self._model = name
        self._layers = frozenset(layer_ids)

    def record_dropped(self, reason: str) -> None:
        """Count one dropped completion-channel message."""
        self.channel_dropped.labels(reason).inc()

    def record(self, completion: Completion) -> None:
        """Apply one completion message: the worker's storage calls and writer state."""
        for op in completion.storage_ops:
            # Label values from closed sets only: whatever a message says, the number
            # of series stays what the server started with.
            known_error = op.error is None or op.error in ERROR_KINDS or op.error == "internal"
            if op.backend == self._backend and op.operation in OPERATIONS and known_error:
                self.storage.observe(op)
        self.bytes_in_flight.set(completion.bytes_in_flight)
        self.peak_bytes_in_flight.set(completion.peak_bytes_in_flight)
        failure = completion.failure
        if failure is not None and failure.type == "invalid_hidden_states" and failure.reason:
            self.invalid_states.labels(failure.reason).inc()
        if completion.stored is not None:
            self.record_states(completion.stored)

    def record_states(self, stored: StoredObject) -> None:
        """Move the token-norm gauge by one stored object's statistics (none: no move)."""
        stats = stored.statistics
        if stats is None or not stats.num_tokens:
            return
        layers = stored.layer_ids or tuple(range(len(stats.sum_token_norm)))
        for layer, total in zip(layers, stats.sum_token_norm, strict=True):
            if layer not in self._layers:
                continue  # not a layer this server serves: no series of its own
            mean, label = total / stats.num_tokens, str(layer)
            previous = self._norms.get(label)
            if previous is not None:
                mean = previous + TOKEN_NORM_WEIGHT * (mean - previous)
            self._norms[label] = mean
            self.token_norm.labels(self._model, label).set(mean)

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()


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
