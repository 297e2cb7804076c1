"""Prometheus metrics of the extractor: the worker's storage calls and its writer.

They are fed from two processes. The API process's own storage calls (reads, deletes,
probes) are observed directly (``service.metrics.StorageMetrics``); the worker's
(writes, and their S3 retries) arrive in the completion messages
(``service.engine.wire.Completion.storage_ops``) and are observed when each message is
received, so ``/metrics`` shows all storage traffic.

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

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from service.metrics import ERROR_KINDS, OPERATIONS, StorageMetrics

if TYPE_CHECKING:
    from service.engine.wire import Completion, StoredObject

#: Why the API dropped a completion-channel message (``service.engine.completion``).
DROP_REASONS = ("unauthenticated", "malformed", "unknown_key")
#: Why stored states were refused (``hsx_extract_invalid_states_total{reason}``).
INVALID_STATES_REASONS = ("non_finite", "all_zero_layer")
#: Weight of each new object in the token-norm gauge's moving average: about the last
#: 20 objects count, so one odd prompt barely moves it and a real change shows within
#: a few dozen requests.
TOKEN_NORM_WEIGHT = 0.05


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
