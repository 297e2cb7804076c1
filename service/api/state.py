"""What the routes share: the extractor, its storage, the keys and admission control."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from service.api.auth import ApiKeys
from service.api.metrics import EngineCollector, ExtractMetrics
from service.api.singleflight import SingleFlight
from service.config import Settings
from service.storage import Storage, scheme_of


@dataclass
class Admission:
    """Prompts admitted but not finished; past ``limit`` new requests get 429.

    Counting happens in the event loop only, so no lock is needed.
    """

    limit: int
    queued: int = 0

    def try_admit(self, prompts: int) -> bool:
        if self.queued + prompts > self.limit:
            return False
        self.queued += prompts
        return True

    def release(self, prompts: int) -> None:
        self.queued -= prompts


@dataclass
class StorageProbe:
    """``/ready``'s storage check, cached so probes do not hammer the backend."""

    storage: Storage
    ttl_s: float = 5.0
    _at: float = -1e9
    _error: str | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def error(self) -> str | None:
        """None when the storage answered within the last ``ttl_s``, else why not."""
        async with self._lock:
            if time.monotonic() - self._at >= self.ttl_s:
                try:
                    await asyncio.wait_for(self.storage.ping(), timeout=5)
                    self._error = None
                except Exception as exc:  # any failure means "not ready"
                    self._error = f"{type(exc).__name__}: {exc}"
                self._at = time.monotonic()
            return self._error


@dataclass
class ApiState:
    """Everything a request handler needs; one per app, made in the lifespan."""

    settings: Settings
    keys: ApiKeys
    registry: CollectorRegistry
    admission: Admission
    extractor: Any = None  # service.engine.extractor.Extractor once started
    draining: bool = False
    probe: StorageProbe | None = None
    metrics: ExtractMetrics | None = None
    engine_metrics: EngineCollector = field(default_factory=EngineCollector)
    #: The extractor's storage, instrumented (reads and deletes).
    storage: Storage | None = None
    #: Idempotent prompts in flight, by key: identical ones share one engine run.
    flights: SingleFlight[Any] = field(default_factory=SingleFlight)

    @property
    def backend(self) -> str:
        return scheme_of(self.settings.storage.url)
