"""Mooncake backend (``mooncake://MASTER_HOST:PORT``): objects in Mooncake's distributed
in-memory store, where speculators' and SpecForge's trainers read hidden states with no
file in between.

Each hsx process is a Mooncake client (``MooncakeDistributedStore``). The engine's
writer contributes ``segment_bytes`` of its memory to the store (a member's
"global segment"); the API process, which only reads and deletes, contributes none.
Objects are written in hs-connectors' layout (``service.packed``: the store's
``container`` is ``packed``), so hs-connectors' ``MooncakeTransfer`` reads them with the
manifest the API answers; ``GET /objects/{key}`` turns them back into the safetensors
bytes they have on other backends.

What the storage contract means here (``docs/design.md``, "Mooncake"):

* Durable: ``put`` returns once the master has committed the object with the
  configured ``replicas``; from then on every member reads it. Nothing survives the
  restart of the master, nor of the member whose memory holds the object.
* Objects are hard-pinned: the master never evicts them. A full store refuses the
  put (``StorageFullError``, a 507), so no object the API answered is ever dropped;
  a trainer's delete after reading gives the bytes back. ``ping`` (``/ready``) calls the
  store full once less than ``min_free_bytes`` of it is free (from ``metrics_url``).
* No namespaces: every member of the store (each trainer) reads and removes every
  object, and the master's metrics port lists every key. A store is one tenant's;
  ``hsx serve`` refuses keys of several namespaces on it unless
  ``shared_by_namespaces`` accepts that (``service.startup.check_shared_store``).
* Not supported: listing (the master has no ordered key listing; ``list`` raises
  ``NotImplementedError`` and ``GET /objects`` says so), expiry (``expires_at``: the
  trainer deletes what it read), empty objects (Mooncake stores nothing for them; an
  hsx object always has a header), and an atomic replace where ``create_only`` is off
  (the old object is removed first). Create-only is ``is_exist`` before the put; where
  two writers race on one key (replicas given one ``custom_id``), Mooncake keeps the
  first object and answers success to both, so a put under an idempotent key reads
  the object back and refuses when it is not its own (``_check_won``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from service.config import MooncakeStorageSettings, StorageSettings
from service.storage.base import (
    AlreadyExistsError,
    NotFoundError,
    ObjectPage,
    ObjectRef,
    Source,
    StorageConfigError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
    StoreUsage,
    ThreadedStorage,
)
from service.storage.keys import is_idempotent_key, validate_key

log = logging.getLogger(__name__)

# Mooncake's status codes (mooncake-store/include/types.h) that mean something here.
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703  # a put of the key is still under way
NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
BUFFER_TOO_SMALL = -600  # the client's transfer buffer cannot hold it
RPC_FAIL = -900  # the master did not answer
#: How long the store's usage (read from the master's metrics) is reused.
USAGE_TTL_S = 1.0
#: How long one read of the master's metrics may take. A loaded master (or machine)
#: answered in over 0.5 s, and the store's series then vanished from a scrape; the
#: read runs in ``/metrics``'s rendering thread, so this bounds that scrape.
USAGE_READ_TIMEOUT_S = 2.0
#: How long a put under an idempotent key waits for a racing writer's put to settle.
RACE_SETTLE_S = 5.0
#: How long joining the store waits for the master's port to answer.
CONNECT_TIMEOUT_S = 5.0


def parse_mooncake_url(url: str) -> tuple[str, int]:
    """``mooncake://HOST:PORT`` -> (host, port) of the master; ValueError otherwise."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "mooncake" or not parts.hostname or port is None:
        raise ValueError(f"not a mooncake://MASTER_HOST:PORT URL: {url!r}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"a mooncake:// URL names only the master's host and port: {url!r}")
    return parts.hostname, port


def _local_hostname(master_host: str, configured: str) -> str:
    """The address other members reach this client at."""
    if configured:
        return configured
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class _Status:
    """One Mooncake call's result turned into our errors."""

    operation: str
    key: str

    def check(self, result: Any) -> int:
        if isinstance(result, int) and result >= 0:
            return result
        message = f"mooncake {self.operation} of {self.key!r} failed with status {result}"
        if result == OBJECT_NOT_FOUND:
            raise NotFoundError(f"no object {self.key!r}", operation=self.operation, key=self.key)
        if result == NO_AVAILABLE_HANDLE:
            raise StorageFullError(
                f"{message}: the store is full (mooncake.segment_bytes); delete objects "
                "that were read",
                operation=self.operation,
                key=self.key,
            )
        if result == RPC_FAIL:
            raise StorageUnavailableError(
                f"{message}: the master does not answer", operation=self.operation, key=self.key
            )
        raise StorageError(message, operation=self.operation, key=self.key)


class UnmountedStoreError(StorageUnavailableError):
    """No member of the store has mounted memory (yet): every write would be refused.

    Right after a master's restart, or before the first writer joins: a process whose
    own writer is about to mount a segment may start anyway (``service.startup``).
    """


class MooncakeStorage(ThreadedStorage):
    """Objects in a Mooncake store, one Mooncake object per hsx object."""

    scheme = "mooncake"
    container = "packed"
    expires = False

    def __init__(
        self,
        master: tuple[str, int],
        options: MooncakeStorageSettings,
        *,
        create_only: bool = True,
        io_threads: int = 8,
    ) -> None:
        super().__init__(io_threads, "hsx-mooncake")
        self.master = master
        self.options = options
        self.create_only = create_only
        self._usage: tuple[float, StoreUsage | None] = (0.0, None)
        self._usage_lock = threading.Lock()
        self._store = self._connect()

    @classmethod
    def from_settings(cls, url: str, settings: StorageSettings) -> MooncakeStorage:
        """Connect to the master ``url`` names; StorageUnavailableError if it does not
        answer, StorageConfigError without the mooncake package."""
        return cls(
            parse_mooncake_url(url),
            settings.mooncake,
            create_only=settings.create_only,
            io_threads=settings.io_threads,
        )

    def _connect(self) -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel, or Debian's libibverbs1/librdmacm1
            raise StorageConfigError(
                f"mooncake:// storage needs the Mooncake client: pip install "
                f"'hsx[mooncake]' (and libibverbs1 librdmacm1): {exc}"
            ) from None
        host, port = self.master
        # setup() waits about 90 s for a master that is not there: fail fast instead,
        # but give one that is still starting (a pod beside ours) a few seconds.
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise StorageUnavailableError(
                        f"mooncake: master {host}:{port} does not answer ({exc})",
                        operation="setup",
                    ) from None
                time.sleep(0.1)
        store = MooncakeDistributedStore()
        result = store.setup(
            _local_hostname(host, self.options.local_hostname),
            self.options.metadata_server,
            self.options.segment_bytes,
            self.options.buffer_bytes,
            self.options.protocol,
            self.options.device_name,
            f"{host}:{port}",
        )
        if result != 0:
            raise StorageUnavailableError(
                f"mooncake: cannot join the store of master {host}:{port} (status {result})",
                operation="setup",
            )
        return store

    def uri(self, key: str) -> str:
        validate_key(key)
        host, port = self.master
        return f"mooncake://{host}:{port}/{key}"

    def _replicate(self) -> Any:
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.options.replicas
        config.with_hard_pin = True  # never evicted: a full store refuses instead
        return config

    # -- ThreadedStorage's blocking calls ---------------------------------------------

    def _publish(self, key: str, source: Source, expires_at: int | None) -> ObjectRef:
        validate_key(key)
        if expires_at is not None:
            raise StorageConfigError(
                "mooncake:// objects cannot expire; the trainer deletes what it read",
                operation="put",
                key=key,
            )
        if source.size > self.options.buffer_bytes:
            raise StorageConfigError(
                f"an object of {source.size} bytes is larger than mooncake.buffer_bytes "
                f"({self.options.buffer_bytes}); raise HSX_STORAGE__MOONCAKE__BUFFER_BYTES",
                operation="put",
                key=key,
            )
        if source.size == 0:  # Mooncake answers success and stores nothing
            raise StorageError("mooncake:// cannot store an empty object", operation="put", key=key)
        if self.create_only and self._exists(key, "put"):
            raise AlreadyExistsError(f"object {key!r} exists", operation="put", key=key)
        if not self.create_only:
            # put_parts keeps an existing object (and answers success); upsert_parts
            # leaks the old copy's memory in 0.3.13. Replacing is remove, then put.
            self._delete(key)
        pieces = list(source.chunks())
        try:
            _Status("put", key).check(self._store.put_parts(key, *pieces, config=self._replicate()))
        except StorageFullError:
            self._unless_unmounted(key)
            raise
        ref = ObjectRef(key, self.uri(key), source.size, source.sha256())
        if self.create_only and is_idempotent_key(key):
            self._check_won(ref)
        return ref

    def _check_won(self, ref: ObjectRef) -> None:
        """Raise AlreadyExistsError unless the object under ``ref.key`` is this put's.

        Two replicas racing on one ``custom_id`` both pass ``is_exist``, and Mooncake's
        ``put_parts`` keeps the first object while answering success to both: the loser
        would answer ``created`` for bytes it did not store. Only keys made from a
        ``custom_id`` can be written twice (every other key is random), so only those
        are read back, once the other writer's put (if any) has settled.
        """
        settled = time.monotonic() + RACE_SETTLE_S
        while self._store.get_size(ref.key) == REPLICA_IS_NOT_READY:
            if time.monotonic() > settled:  # another writer's put still holds the key
                raise AlreadyExistsError(
                    f"object {ref.key!r} is being written", operation="put", key=ref.key
                )
            time.sleep(0.005)
        if self._head(ref.key).sha256 != ref.sha256:
            raise AlreadyExistsError(f"object {ref.key!r} exists", operation="put", key=ref.key)

    def _unless_unmounted(self, key: str) -> None:
        """A refusal is "full" only if the store has memory: right after a master's
        restart no member has mounted any yet, and the store is unavailable instead."""
        usage = self.usage()
        if usage is not None and usage.capacity_bytes == 0:
            raise UnmountedStoreError(self._unmounted, operation="put", key=key)

    @property
    def _unmounted(self) -> str:
        host, port = self.master
        return f"mooncake: no member of master {host}:{port}'s store has memory mounted"

    def _get(self, key: str) -> bytes:
        validate_key(key)
        size = _Status("get", key).check(self._store.get_size(key))
        data = self._store.get(key)
        if len(data) != size:  # removed between the two calls
            raise NotFoundError(f"no object {key!r}", operation="get", key=key)
        return bytes(data)

    def _head(self, key: str) -> ObjectRef:
        data = self._get(key)
        return ObjectRef(key, self.uri(key), len(data), hashlib.sha256(data).hexdigest())

    def _exists(self, key: str, operation: str = "exists") -> bool:
        return _Status(operation, key).check(self._store.is_exist(key)) == 1

    async def exists(self, key: str) -> bool:
        validate_key(key)
        return await self._run(self._exists, key)

    def _delete(self, key: str) -> None:
        validate_key(key)
        result = self._store.remove(key, force=True)
        if result != OBJECT_NOT_FOUND:
            _Status("delete", key).check(result)

    async def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            validate_key(key)
        if keys:
            await self._run(self._delete_batch, list(keys))

    def _delete_batch(self, keys: list[str]) -> None:
        for key, result in zip(keys, self._store.batch_remove(keys, force=True), strict=True):
            if result != OBJECT_NOT_FOUND:
                _Status("delete", key).check(result)

    def _ping(self) -> None:
        host, port = self.master
        if self._store.health_check() != 0:
            raise StorageUnavailableError(
                f"mooncake: master {host}:{port} is unreachable", operation="ping"
            )
        # health_check only says what the last heartbeat saw: ask the master itself.
        _Status("ping", "hsx-ping").check(self._store.is_exist("hsx-ping"))
        self._check_room(self.usage())

    def _check_room(self, usage: StoreUsage | None) -> None:
        """Raise unless the store (as its master's metrics last said) can take a write."""
        if usage is None:  # no metrics_url, or unreadable: nothing to tell by
            return
        # A restarted master answers before the members have mounted their memory again:
        # until then every write would be refused.
        if usage.capacity_bytes == 0:
            raise UnmountedStoreError(self._unmounted, operation="ping")
        free = usage.capacity_bytes - usage.bytes
        if free < self.options.min_free_bytes:
            raise StorageFullError(
                f"mooncake: the store is full: {free} of {usage.capacity_bytes} bytes free, "
                f"below mooncake.min_free_bytes ({self.options.min_free_bytes}); delete "
                "objects that were read",
                operation="ping",
            )

    def _list(self, prefix: str, limit: int, after: str | None) -> ObjectPage:
        raise NotImplementedError("mooncake:// storage cannot list objects")

    async def list(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> ObjectPage:
        raise NotImplementedError(
            "mooncake:// storage cannot list objects (Mooncake's master has no ordered "
            "listing); keep the keys the API answered"
        )

    async def close(self) -> None:
        await super().close()
        store, self._store = self._store, None
        if store is not None:
            store.close()

    # -- the store's own state ----------------------------------------------------------

    def usage(self) -> StoreUsage | None:
        """Bytes, capacity, objects and evictions of the whole store, from the master's
        metrics (``mooncake.metrics_url``), at most once a second; None if unset or
        unreachable."""
        url = self.options.metrics_url
        if not url:
            return None
        with self._usage_lock:
            when, usage = self._usage
            if usage is not None and time.monotonic() - when < USAGE_TTL_S:
                return usage
            # A failed read is not reused: the next scrape reads again rather than
            # showing no store series for a second.
            usage = _read_usage(url) or _read_usage(url)
            self._usage = (time.monotonic(), usage)
            return usage


#: The master's metrics each StoreUsage field comes from.
_MASTER_METRICS = {
    "master_allocated_bytes": "bytes",
    "master_total_capacity_bytes": "capacity_bytes",
    "master_key_count": "objects",
    "master_evicted_key_count": "evicted_objects",
}


def _read_usage(url: str) -> StoreUsage | None:
    try:
        with urllib.request.urlopen(url, timeout=USAGE_READ_TIMEOUT_S) as response:  # noqa: S310 - a setting
            text = response.read(1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        log.warning("mooncake: master metrics at %s unreadable: %s", url, exc)
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        field = _MASTER_METRICS.get(name)
        if field is not None:
            try:
                found[field] = int(float(value))
            except ValueError:
                continue
    if len(found) != len(_MASTER_METRICS):
        missing = [name for name, field in _MASTER_METRICS.items() if field not in found]
        log.warning("mooncake: master metrics at %s lack %s", url, ", ".join(missing))
        return None
    return StoreUsage(**found)
