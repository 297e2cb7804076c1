"""What the routes share: the extractor, its storage, the keys and admission control."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from service.api.auth import ApiKeys
from service.api.body_limit import BodyBudget
from service.api.errors import ApiError
from service.api.extractor import ExtractorLike
from service.api.metrics import EngineCollector, ExtractMetrics
from service.api.singleflight import SingleFlight
from service.config import Settings
from service.engine.wire import Extraction
from service.storage import Storage, StorageFullError, scheme_of

log = logging.getLogger(__name__)


@dataclass
class Admission:
    """Prompts admitted but not finished; past ``limit`` new requests get 429.

    Counting happens in the event loop only, so no lock is needed.
    """

    limit: int
    queued: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def try_admit(self, prompts: int) -> bool:
        if self.queued + prompts > self.limit:
            return False
        self.queued += prompts
        self._idle.clear()
        return True

    def release(self, prompts: int) -> None:
        self.queued -= prompts
        if not self.queued:
            self._idle.set()

    async def idle(self) -> None:
        """Return once no admitted prompt is unfinished."""
        if self.queued:
            await self._idle.wait()


@dataclass
class StorageProbe:
    """``/ready``'s storage check, cached so probes do not hammer the backend.

    Ready means the storage can take a write: it answers its ping (which a bounded
    store, Mooncake's, fails with StorageFullError once it is full) and, on local disk,
    its file system keeps at least ``min_free_bytes`` free (a full disk fails every
    write with ENOSPC). The reason goes to the log; probes see no paths or buckets.
    """

    storage: Storage
    root: Path | None = None  # local disk: the storage root, whose free space counts
    min_free_bytes: int = 0
    ttl_s: float = 5.0
    _at: float = -1e9
    _error: str | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def error(self) -> str | None:
        """None when the storage could take a write within the last ``ttl_s``, else why not."""
        async with self._lock:
            if time.monotonic() - self._at >= self.ttl_s:
                self._error = await self._check()
                self._at = time.monotonic()
            return self._error

    async def _check(self) -> str | None:
        try:
            await asyncio.wait_for(self.storage.ping(), timeout=5)
        except StorageFullError as exc:  # reachable, but every write would get a 507
            log.warning("hsx: storage not ready: %s", exc)
            return "full"
        except Exception as exc:  # any other failure means "not ready"
            log.warning("hsx: storage not ready: %s: %s", type(exc).__name__, exc)
            return "unavailable"
        root = self.root
        if root is not None:
            free = (await asyncio.to_thread(shutil.disk_usage, root)).free
            if free < self.min_free_bytes:
                log.warning(
                    "hsx: storage not ready: %d bytes free under %s, below %d",
                    free,
                    root,
                    self.min_free_bytes,
                )
                return "too little free space"
        return None


@dataclass
class ApiState:
    """Everything a request handler needs; one per app, built whole in the lifespan once
    the extractor has started, then published (``app.state.hsx``)."""

    settings: Settings
    keys: ApiKeys
    registry: CollectorRegistry
    admission: Admission
    body_budget: BodyBudget
    metrics: ExtractMetrics
    engine_metrics: EngineCollector
    extractor: ExtractorLike
    #: ``/ready``'s storage check.
    probe: StorageProbe
    #: The extractor's storage, instrumented (reads and deletes).
    storage: Storage
    #: Runs the tokenizer off the event loop; bounded, so tokenising cannot take every core.
    tokenizer_pool: ThreadPoolExecutor
    #: UTF-8 bytes of the longest token: a text longer than tokens * this cannot fit.
    max_token_bytes: int
    #: The model's name as clients and metrics see it (never a server path).
    model_name: str
    draining: bool = False
    #: Idempotent prompts in flight, by key: identical ones share one engine run.
    flights: SingleFlight[Extraction] = field(default_factory=SingleFlight)

    @property
    def backend(self) -> str:
        return scheme_of(self.settings.storage.url)


def ensure_serving(state: ApiState) -> None:
    """ApiError 503 while the app drains or once the engine has died."""
    if state.draining:
        raise ApiError(
            503, "unavailable", "the service is shutting down", headers={"Retry-After": "5"}
        )
    if not state.extractor.alive:
        raise ApiError(503, "unavailable", "the engine is dead")
