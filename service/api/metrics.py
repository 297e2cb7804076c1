"""hsx's own metrics of the API process: extraction, rejections, engine layout, memory.

Built per app on the app's registry (``/metrics`` also serves the process default
registry, where vLLM keeps its ``vllm:*`` metrics). Names follow Prometheus practice:
base units in the name, ``_total`` counters, small fixed label sets; never a key, a
namespace or a request id as a label.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from service.engine.errors import FAILURES, ExtractionError
from service.engine.wire import Extraction

# A request spans milliseconds (one short prompt) to minutes (a full batch).
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Copy-out and write of one object.
OBJECT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

#: The outcomes of one /extract request (the ``outcome`` label): ok, refused before the
#: engine, aborted, or the error type of its worst prompt (``service.engine.errors``).
OUTCOMES = (
    "ok",
    "rejected",
    "timeout",
    "disconnected",
    *(error.error_type for error in FAILURES),
)


#: Error types of requests refused before the engine (the ``reason`` label).
REJECTIONS = (
    "invalid_request",
    "limit_exceeded",
    "payload_too_large",
    "unauthorized",
    "overloaded",
    "unavailable",
)


class ExtractMetrics:
    """Counters and histograms of ``POST /extract``."""

    def __init__(self, registry: CollectorRegistry, backend: str) -> None:
        self.backend = backend
        self.requests = Counter(
            "hsx_extract_requests", "Extract requests by outcome.", ["outcome"], registry=registry
        )
        self.prompts = Counter(
            "hsx_extract_prompts",
            "Prompts by outcome (ok: written; found: stored before under its custom_id).",
            ["outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "hsx_extract_tokens", "Tokens whose hidden states were stored.", registry=registry
        )
        self.bytes = Counter(
            "hsx_extract_written_bytes", "Bytes of objects written.", ["backend"], registry=registry
        )
        self.duration = Histogram(
            "hsx_extract_duration_seconds",
            "End-to-end time of extract requests that reached the engine.",
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.copy = Histogram(
            "hsx_extract_copy_duration_seconds",
            "Copy-out of one object's states from the KV cache.",
            buckets=OBJECT_BUCKETS,
            registry=registry,
        )
        self.write = Histogram(
            "hsx_extract_write_duration_seconds",
            "Serialising and writing one object.",
            buckets=OBJECT_BUCKETS,
            registry=registry,
        )
        self.rejections = Counter(
            "hsx_extract_rejections",
            "Requests refused before the engine, by error type.",
            ["reason"],
            registry=registry,
        )
        self.aborts = Counter(
            "hsx_extract_aborts",
            "Requests whose engine work was aborted.",
            ["reason"],
            registry=registry,
        )
        self.bytes_limit = Gauge(
            "hsx_writer_bytes_in_flight_limit_bytes",
            "The ceiling on bytes in flight.",
            registry=registry,
        )
        self.prompts_in_flight = Gauge(
            "hsx_extract_prompts_in_flight",
            "Prompts admitted and not yet finished.",
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every series exists from the start: rate() works
        for outcome in ("ok", "found", "failed"):
            self.prompts.labels(outcome)
        self.bytes.labels(backend)
        for reason in ("disconnect", "deadline"):
            self.aborts.labels(reason)
        for reason in REJECTIONS:
            self.rejections.labels(reason)

    def rejected(self, reason: str) -> None:
        """A request refused before it reached the engine (``reason``: the error type)."""
        self.rejections.labels(reason).inc()
        self.requests.labels("rejected").inc()

    def aborted(self, reason: str, duration_s: float) -> None:
        """Engine work abandoned: ``disconnect`` or ``deadline``."""
        self.aborts.labels(reason).inc()
        self.requests.labels("disconnected" if reason == "disconnect" else "timeout").inc()
        self.duration.observe(duration_s)

    def record(
        self, outcome: str, outcomes: Sequence[Extraction | ExtractionError], duration_s: float
    ) -> None:
        """One request that reached the engine: its outcome and every prompt's."""
        self.requests.labels(outcome).inc()
        self.duration.observe(duration_s)
        for item in outcomes:
            if isinstance(item, ExtractionError):
                self.prompts.labels("failed").inc()
                continue
            if getattr(item, "found", False):  # stored before (custom_id): nothing written
                self.prompts.labels("found").inc()
                continue
            self.prompts.labels("ok").inc()
            self.tokens.inc(item.num_tokens)
            self.bytes.labels(self.backend).inc(item.size)
            self.copy.observe(item.copy_s)
            self.write.observe(item.write_s)


class EngineCollector(Collector):
    """KV-cache layout and worker memory, from snapshots the app refreshes.

    ``layouts`` holds one layout per data-parallel engine (its rank 0's: the ranks of
    one engine hold the same groups), each carrying its ``engine``; every KV series
    has an ``engine`` label, so no two engines' series are alike."""

    def __init__(self) -> None:
        self.layouts: list[dict[str, Any]] = []
        self.memory: list[dict[str, Any]] = []

    @property
    def layout(self) -> dict[str, Any] | None:
        """The first engine's layout (every engine of a server has the same settings)."""
        return self.layouts[0] if self.layouts else None

    def collect(self) -> Iterable[Metric]:
        yield from self._layout()
        yield from self._memory()

    def _layout(self) -> Iterable[Metric]:
        totals = {
            "hsx_kv_cache_groups": "KV-cache groups of the engine.",
            "hsx_kv_cache_blocks": "KV-cache blocks (shared by all groups).",
            "hsx_kv_cache_memory_bytes": "KV-cache memory allocated.",
            "hsx_kv_cache_hidden_state_memory_bytes": (
                "KV-cache memory addressed by the hidden-state layer."
            ),
        }
        if not self.layouts:
            return
        families = {
            name: GaugeMetricFamily(name, text, labels=["engine"]) for name, text in totals.items()
        }
        info = InfoMetricFamily(
            "hsx_kv_cache_group",
            "One KV-cache group.",
            labels=["engine", "group", "kind", "block_size", "layers"],
        )
        page = GaugeMetricFamily(
            "hsx_kv_cache_group_page_size_bytes",
            "Bytes of one block of the group (all its layers).",
            labels=["engine", "group"],
        )
        memory = GaugeMetricFamily(
            "hsx_kv_cache_group_memory_bytes",
            "KV-cache bytes the group's layers address.",
            labels=["engine", "group"],
        )
        for layout in self.layouts:
            engine = str(layout.get("engine", 0))
            groups = layout["groups"]
            families["hsx_kv_cache_groups"].add_metric([engine], len(groups))
            families["hsx_kv_cache_blocks"].add_metric([engine], layout["num_blocks"])
            families["hsx_kv_cache_memory_bytes"].add_metric([engine], layout["memory_bytes"])
            families["hsx_kv_cache_hidden_state_memory_bytes"].add_metric(
                [engine], layout["hidden_state_memory_bytes"]
            )
            for g in groups:
                index = str(g["index"])
                info.add_metric(
                    [engine, index, g["kind"], str(g["block_size"]), str(g["layers"])], {}
                )
                page.add_metric([engine, index], g["page_size_bytes"])
                memory.add_metric([engine, index], g["memory_bytes"])
        yield from (*families.values(), info, page, memory)

    def _memory(self) -> Iterable[Metric]:
        fields = {
            "total_bytes": "Device memory (CPU: host memory).",
            "free_bytes": "Free device memory (CPU: available host memory).",
            "used_bytes": "Used device memory (total minus free).",
            "kv_cache_bytes": "KV-cache memory of the worker.",
            "model_weights_bytes": "Model weights of the worker.",
        }
        for field, text in fields.items():
            family = GaugeMetricFamily(
                f"hsx_memory_{field}", text, labels=["device", "engine", "rank"]
            )
            for worker in self.memory:
                place = [str(worker.get("engine", 0)), str(worker.get("rank", 0))]
                family.add_metric([worker["device"], *place], worker[field])
            yield family


def build_info(registry: CollectorRegistry, model: str) -> None:
    """``hsx_build_info{model} 1``: the served name. Versions stay behind a key (/version)."""
    gauge = Gauge("hsx_build_info", "The served model.", ["model"], registry=registry)
    gauge.labels(model).set(1)
