"""Mooncake backend against a real ``mooncake_master`` on 127.0.0.1.

The storage contract runs where it applies; listing and expiry, which the backend
refuses by design, are replaced by tests of that refusal. Then what is Mooncake's own:
a full store refuses (never evicts), a member with no segment (the API process) reads
what the writer put, the store's usage from the master's metrics, a master that dies
and comes back, and hs-connectors' reader (speculators' trainer) reading our objects.

One master serves the module; the writer's client (whose close takes ~2 s) too, with
the store emptied after each test. The crash test has a master of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service import codecs
from service.config import MooncakeStorageSettings, StorageSettings
from service.packed import pack, to_safetensors
from service.storage import (
    AlreadyExistsError,
    InvalidKeyError,
    NotFoundError,
    Storage,
    StorageConfigError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
    open_backend,
)
from service.storage.base import Swept
from service.storage.mooncake import MooncakeStorage, parse_mooncake_url
from tests.storage.contract import (
    BIG,
    Plant,
    StorageContract,
    eventually,
    fresh_key,
    payload,
)
from tests.support.mooncake import MooncakeMaster, running_master

# A real mooncake_master per test that needs one, restarts included: about 20 s of a
# worker's time in all, so `make test` runs these, not `make test-fast`.
pytestmark = pytest.mark.slow

MIB = 1024 * 1024
#: The writer's segment: the store's whole capacity in this module.
SEGMENT = 32 * MIB
#: Each client's transfer buffer: above the contract's BIG object.
BUFFER = 16 * MIB
assert BUFFER > BIG

#: A known backend bug, kept visible: strict, so the test fails once it is fixed.


def settings_for(master: MooncakeMaster, **options: Any) -> StorageSettings:
    """hsx's storage settings for ``master``'s store (this host's address left for the
    backend to find: 127.0.0.1, the master being on loopback); ``options`` override."""
    values: dict[str, Any] = {
        "segment_bytes": SEGMENT,
        "buffer_bytes": BUFFER,
        **options,
    }
    return StorageSettings(url=master.url, mooncake=MooncakeStorageSettings(**values))


def connect(master: MooncakeMaster, **options: Any) -> MooncakeStorage:
    backend = open_backend(settings_for(master, **options))
    assert isinstance(backend, MooncakeStorage)
    return backend


async def put_unless_full(storage: Storage, key: str, data: bytes) -> bool:
    """Put ``data``; False where the store is full."""
    try:
        await storage.put(key, data)
    except StorageFullError:
        return False
    return True


# -- the module's store ------------------------------------------------------------------


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    with running_master(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@pytest.fixture(scope="module")
def writer(master: MooncakeMaster) -> Iterator[MooncakeStorage]:
    """The engine's writer: the only member that contributes memory (``SEGMENT``)."""
    backend = connect(master, metrics_url=master.metrics_url)
    yield backend
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def reader(master: MooncakeMaster) -> Iterator[MooncakeStorage]:
    """The API process: a member with no segment, which reads and deletes."""
    backend = connect(master, segment_bytes=0)
    yield backend
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def admin(master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client, as an operator (or another program) would use one."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    status = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, BUFFER, "tcp", "", master.address)
    assert status == 0, master.output()[-3000:]
    yield store
    store.close()


def empty(admin: Any) -> None:
    assert admin.remove_all(force=True) >= 0


@pytest.fixture
def storage(writer: MooncakeStorage, admin: Any) -> Iterator[MooncakeStorage]:
    """The writer on an empty store, emptied again afterwards (fresh keys anyway)."""
    empty(admin)
    yield writer
    empty(admin)


# -- the contract, where it applies ------------------------------------------------------


class TestMooncakeContract(StorageContract):
    """Every contract test runs unchanged but listing and expiry, which Mooncake's
    backend refuses: those are replaced by tests of the refusal."""

    @pytest.fixture
    def plant(self, storage: MooncakeStorage, admin: Any) -> Plant:
        async def plant(name: str, data: bytes) -> None:  # another client of the store
            assert admin.put(name, data) == 0

        return plant

    # The contract's own test but for the empty object, which Mooncake cannot store
    # (its put answers success and stores nothing): refused instead, below.
    @pytest.mark.parametrize("size", [1, 4096, 1024 * 1024 + 7])
    async def test_round_trip_is_byte_exact(self, storage: Storage, size: int) -> None:
        await super().test_round_trip_is_byte_exact(storage, size)

    async def test_an_empty_object_is_refused(self, storage: Storage) -> None:
        key = fresh_key()
        with pytest.raises(StorageError, match="empty"):
            await storage.put(key, b"")
        assert not await storage.exists(key)

    # -- listing: refused ----------------------------------------------------------------

    async def test_list_pages_in_key_order(self, storage: Storage) -> None:
        keys = [fresh_key("tenant-a") for _ in range(3)]
        for key in keys:
            await storage.put(key, b"x")
        with pytest.raises(NotImplementedError, match="cannot list") as info:
            await storage.list("hsx/tenant-a/", limit=5)
        assert "keep the keys" in str(info.value)  # what to do instead
        assert [await storage.get(key) for key in keys] == [b"x"] * 3

    async def test_list_continues_after_a_deleted_key(self, storage: Storage) -> None:
        key = fresh_key("tenant-c")
        await storage.put(key, b"x")
        with pytest.raises(NotImplementedError, match="cannot list"):
            await storage.list("hsx/tenant-c/", limit=3, after=key)

    async def test_list_of_nothing(self, storage: Storage) -> None:
        for prefix in ("hsx/tenant-e/", "hsx/tenant-d/1999/", "nothing"):
            with pytest.raises(NotImplementedError, match="cannot list"):
                await storage.list(prefix, limit=10)

    @pytest.mark.parametrize("prefix", ["/abs", "../x", "a/../b", "a//b", "a/./b", ".hid", "a\\b"])
    async def test_list_refuses_bad_prefixes(self, storage: Storage, prefix: str) -> None:
        with pytest.raises(NotImplementedError, match="cannot list"):  # any listing
            await storage.list(prefix)

    async def test_list_refuses_bad_limit_and_after(self, storage: Storage) -> None:
        with pytest.raises(NotImplementedError, match="cannot list"):
            await storage.list("hsx/", limit=0)
        with pytest.raises(NotImplementedError, match="cannot list"):
            await storage.list("hsx/", after="../x")

    @pytest.mark.parametrize("limit", [1, 2, 1000])
    async def test_list_skips_entries_that_are_not_keys(
        self, storage: Storage, plant: Plant, limit: int
    ) -> None:
        # Nothing is listed; what another client put under a name no key can have
        # still cannot be read through hsx.
        for name in self.STRAYS:
            await plant(name, b"stray")
        with pytest.raises(NotImplementedError, match="cannot list"):
            await storage.list("hsx/tenant-s/", limit=limit)
        for name in self.STRAYS:
            with pytest.raises(InvalidKeyError):
                await storage.get(name)

    # -- expiry: refused, and nothing is published ------------------------------------

    async def assert_expiry_refused(self, storage: Storage, key: str, data: bytes) -> None:
        assert storage.expires is False  # the API refuses ttl_s before it gets here
        for expires_at in (int(time.time()) - 1, int(time.time()) + 3600):
            with pytest.raises(StorageConfigError, match="cannot expire") as info:
                await storage.put(key, data, expires_at=expires_at)
            assert (info.value.operation, info.value.key) == ("put", key)
            assert not await storage.exists(key)
            with pytest.raises(NotFoundError):
                await storage.get(key)

    @pytest.mark.parametrize("size", [100, BIG])
    async def test_an_expired_object_is_gone_at_once(self, storage: Storage, size: int) -> None:
        refused, forever = fresh_key("tenant-e"), fresh_key("tenant-e")
        await self.assert_expiry_refused(storage, refused, payload(size, 1))
        await storage.put(forever, payload(size, 3))
        assert await storage.get(forever) == payload(size, 3)

    async def test_a_key_put_again_without_expiry_does_not_inherit_one(
        self, storage: Storage
    ) -> None:
        key = fresh_key()
        await self.assert_expiry_refused(storage, key, b"short-lived")
        await storage.put(key, b"kept")
        assert await storage.get(key) == b"kept"

    @pytest.mark.parametrize("size", [100, BIG])
    async def test_an_expired_objects_key_can_be_put_again(
        self, storage: Storage, size: int
    ) -> None:
        key = fresh_key()
        await self.assert_expiry_refused(storage, key, b"old")
        await storage.put(key, payload(size, 7))  # the refused put left nothing behind
        assert await storage.get(key) == payload(size, 7)
        with pytest.raises(AlreadyExistsError):
            await storage.put(key, b"third")

    async def test_clean_keeps_what_has_not_expired(self, storage: Storage) -> None:
        forever = fresh_key()
        await self.assert_expiry_refused(storage, fresh_key(), b"live")
        await storage.put(forever, b"forever")
        assert await storage.clean() == Swept(0, 0)  # nothing expires, nothing to sweep
        assert await storage.get(forever) == b"forever"

    async def test_delete_many_removes_exactly_the_batch(self, storage: Storage) -> None:
        # The contract's version lists what is left and puts with an expiry: here,
        # each key is asked for.
        keys = sorted(fresh_key("tenant-d") for _ in range(5))
        await self.assert_expiry_refused(storage, keys[0], b"x")
        for key in keys:
            await storage.put(key, b"x")
        await storage.delete_many([*keys[:3], fresh_key("tenant-d")])  # a missing one too
        await storage.delete_many(keys[:3])  # idempotent
        await storage.delete_many([])
        assert [await storage.exists(key) for key in keys] == [False] * 3 + [True] * 2
        assert [await storage.get(key) for key in keys[3:]] == [b"x", b"x"]


# -- URL and settings ------------------------------------------------------------------


def test_parse_mooncake_url() -> None:
    assert parse_mooncake_url("mooncake://127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_mooncake_url("mooncake://master.example:9000/") == ("master.example", 9000)
    bad = [
        "s3://127.0.0.1:50051",  # another scheme
        "http://127.0.0.1:50051",
        "mooncake://127.0.0.1",  # no port
        "mooncake://127.0.0.1:port",
        "mooncake://:50051",  # no host
    ]
    for url in bad:
        with pytest.raises(ValueError, match=r"mooncake://MASTER_HOST:PORT"):
            parse_mooncake_url(url)
    for url in ("mooncake://127.0.0.1:50051/objects", "mooncake://h:1/a/b", "mooncake://h:1?x=1"):
        with pytest.raises(ValueError, match="only the master's host and port"):
            parse_mooncake_url(url)


def test_a_bad_mooncake_url_is_refused_before_connecting() -> None:
    with pytest.raises(ValueError, match=r"mooncake://MASTER_HOST:PORT"):
        open_backend(StorageSettings(url="mooncake://127.0.0.1"))


def test_segment_bytes_is_zero_or_mountable() -> None:
    with pytest.raises(ValidationError, match="16 MiB"):
        MooncakeStorageSettings(segment_bytes=MIB)
    with pytest.raises(ValidationError, match="16 MiB"):
        StorageSettings.model_validate(
            {"url": "mooncake://h:1", "mooncake": {"segment_bytes": 16 * MIB - 1}}
        )
    with pytest.raises(ValidationError):
        MooncakeStorageSettings(segment_bytes=-1)
    assert MooncakeStorageSettings(segment_bytes=0).segment_bytes == 0  # a reader
    assert MooncakeStorageSettings(segment_bytes=16 * MIB).segment_bytes == 16 * MIB
    with pytest.raises(ValidationError):
        MooncakeStorageSettings(buffer_bytes=MIB - 1)


# -- Mooncake's own behaviour -----------------------------------------------------------


async def test_the_backend_describes_itself(
    storage: MooncakeStorage, master: MooncakeMaster
) -> None:
    key = fresh_key()
    assert (storage.scheme, storage.container, storage.expires) == ("mooncake", "packed", False)
    assert storage.uri(key) == f"{master.url}/{key}"
    with pytest.raises(InvalidKeyError):
        storage.uri("../x")


async def test_an_object_above_buffer_bytes_is_refused(storage: MooncakeStorage) -> None:
    key = fresh_key()
    with pytest.raises(StorageConfigError, match="buffer_bytes"):
        await storage.put(key, [payload(BUFFER), b"!"])
    assert not await storage.exists(key)


async def test_with_create_only_off_a_put_replaces_the_object(storage: MooncakeStorage) -> None:
    # What create_only=False means on the other backends: the last put wins.
    key = fresh_key()
    await storage.put(key, b"first")
    storage.create_only = False
    try:
        ref = await storage.put(key, b"second!")
    finally:
        storage.create_only = True
    assert (await storage.head(key)).sha256 == ref.sha256
    assert await storage.get(key) == b"second!"


async def test_a_full_store_refuses_until_something_is_deleted(
    storage: MooncakeStorage, reader: MooncakeStorage, master: MooncakeMaster
) -> None:
    # Objects are hard-pinned: the master never evicts one to make room.
    size = 6 * MIB
    stored: list[str] = []
    for i in range(SEGMENT // size + 2):
        key, data = fresh_key(), payload(size, seed=i)
        if not await put_unless_full(storage, key, data):
            break
        stored.append(key)
    else:
        pytest.fail(f"{len(stored)} objects of {size} bytes fit in a segment of {SEGMENT}")
    assert len(stored) >= SEGMENT // size - 1  # the store was full, not failing early
    with pytest.raises(StorageFullError, match="full") as info:  # and stays full
        await storage.put(key, data)
    assert (info.value.kind, info.value.operation, info.value.key) == ("full", "put", key)
    assert not await storage.exists(key)
    with pytest.raises(NotFoundError):
        await storage.get(key)
    for i, earlier in enumerate(stored):  # nothing was evicted
        assert await storage.get(earlier) == payload(size, seed=i)
    assert master.metrics()["master_evicted_key_count"] == 0
    await reader.delete(stored[0])  # a trainer read it and gives the memory back
    await storage.put(key, data)
    assert await reader.get(key) == data


async def test_ping_calls_the_store_full_below_min_free_bytes(
    storage: MooncakeStorage, reader: MooncakeStorage
) -> None:
    """What ``/ready`` asks: full once less than ``min_free_bytes`` is free, by the
    master's metrics (its allocator refuses even small puts with some memory free)."""
    assert storage.options.min_free_bytes == 4 * MIB  # the default

    async def ping_says(full: bool) -> bool:  # usage() is reused for a second: poll
        try:
            await storage.ping()
        except StorageFullError:
            return full
        return not full

    await eventually(lambda: ping_says(False), 10, "ping called an empty store full")
    size = 6 * MIB  # 5 fit in the segment, leaving 2 MiB: below the margin
    stored = [
        key
        for key in (fresh_key() for _ in range(5))
        if await put_unless_full(storage, key, payload(size))
    ]
    assert len(stored) == 5
    await eventually(lambda: ping_says(True), 5, "ping never called the store full")
    with pytest.raises(StorageFullError, match=r"below mooncake\.min_free_bytes") as info:
        await storage.ping()
    assert (info.value.kind, info.value.operation) == ("full", "ping")
    await reader.delete(stored[0])  # a trainer read one: 8 MiB free
    await eventually(lambda: ping_says(False), 10, "ping never saw the room a delete made")


async def test_a_member_without_a_segment_reads_what_the_writer_put(
    storage: MooncakeStorage, reader: MooncakeStorage
) -> None:
    assert reader.options.segment_bytes == 0
    items = {fresh_key(): payload(size, seed=size) for size in (1, 4096, MIB, BIG)}
    for key, data in items.items():
        await storage.put(key, data)
    for key, data in items.items():
        assert await reader.exists(key)
        assert await reader.get(key) == data
        head = await reader.head(key)
        assert (head.size, head.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert head.uri == storage.uri(key)
    keys = list(items)
    await reader.delete(keys[0])
    await reader.delete_many(keys[1:3])
    assert [await storage.exists(key) for key in keys] == [False, False, False, True]
    await reader.ping()


async def test_usage_is_the_masters_count_of_what_was_put(
    storage: MooncakeStorage, reader: MooncakeStorage, master: MooncakeMaster
) -> None:
    sizes = [1000, 4096, MIB + 7]
    keys = [fresh_key() for _ in sizes]

    async def counted(objects: int) -> Any:
        usage = storage.usage()  # reused for up to a second: wait it out
        return usage if usage is not None and usage.objects == objects else None

    # Mooncake's upsert (an earlier test's overwrite) leaves its old replica's few bytes
    # counted as allocated after the object is gone: count from what is there now.
    before = await eventually(lambda: counted(0), 5, "usage() never saw an empty store")
    for key, size in zip(keys, sizes, strict=True):
        await storage.put(key, payload(size))
    usage = await eventually(lambda: counted(3), 5, "usage() never counted the 3 objects")
    assert usage.bytes >= before.bytes + sum(sizes)
    assert usage.bytes == master.metrics()["master_allocated_bytes"]
    assert usage.capacity_bytes == SEGMENT  # only the writer mounts a segment
    assert usage.evicted_objects == 0
    await storage.delete_many(keys)

    async def freed() -> Any:  # the master frees the bytes a little after the keys
        usage = await counted(0)
        return usage if usage is not None and usage.bytes == before.bytes else None

    await eventually(freed, 10, "usage() never saw the objects' bytes go")
    assert reader.usage() is None  # no metrics_url: not exported


async def test_hs_connectors_reads_a_packed_object_bit_for_bit(
    storage: MooncakeStorage, master: MooncakeMaster
) -> None:
    """speculators' trainer reads our objects with hs-connectors' own reader."""
    import torch
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    generator = torch.Generator().manual_seed(0)
    states = torch.randn(13, 3, 40, generator=generator)  # [T, L, H]: 40 * 4 bytes per row
    token_ids = torch.randint(0, 50_000, (13,), generator=generator)
    mask = (torch.arange(13) % 3 == 0).to(torch.uint8)
    meta = {"dtype": "float32", "layer_ids": "[2, 15, 27]"}
    prepared = codecs.prepare("raw", states)
    parts = codecs.pack_parts("raw", prepared, token_ids, meta, {"loss_mask": mask})
    key = fresh_key()
    packed = pack(parts, key)
    ref = await storage.put(key, packed.parts)
    assert ref.size == packed.nbytes == packed.manifest["metadata"]["total_aligned_bytes"]

    config = MooncakeStoreConfig(
        master_server_address=master.address,
        global_segment_size=0,
        local_buffer_size=16 * MIB,
        local_hostname="127.0.0.1",
    )
    trainer = MooncakeHiddenStatesStore(config).setup()
    try:
        sample = await asyncio.to_thread(trainer.get_sample, packed.manifest, 10.0)
    finally:
        store: Any = trainer._store  # hs-connectors' store has no close of its own
        store.close()
    assert set(sample) == {"hidden_states", "token_ids", "loss_mask"}
    assert torch.equal(sample["hidden_states"], states)
    assert torch.equal(sample["token_ids"], token_ids.to(torch.int64))
    assert torch.equal(sample["loss_mask"], mask)
    # And the same object is the safetensors file it is on every other backend.
    assert to_safetensors(await storage.get(key)) == b"".join(bytes(p) for p in parts)


async def test_a_dead_master_fails_fast_and_a_restarted_one_serves_again(
    tmp_path: Path,
) -> None:
    # A master of its own: this test kills it.
    with running_master(tmp_path) as own:
        backend = connect(own, segment_bytes=16 * MIB, metrics_url=own.metrics_url)
        try:
            before = fresh_key()
            await backend.put(before, b"before the crash")
            await backend.ping()

            own.kill()
            with pytest.raises(StorageUnavailableError, match="master"):
                await asyncio.wait_for(backend.ping(), 20)
            key = fresh_key()
            with pytest.raises(StorageUnavailableError, match="-900"):
                await asyncio.wait_for(backend.put(key, b"lost"), 20)

            async def no_usage() -> bool:  # the metrics are gone with the master
                return backend.usage() is None

            await eventually(no_usage, 5, "usage() still answered with the master dead")

            own.restart()  # same ports, an empty store

            async def serves_again() -> bool:
                try:
                    await asyncio.wait_for(backend.ping(), 10)
                    await asyncio.wait_for(backend.put(key, b"after the restart"), 10)
                except (StorageUnavailableError, StorageFullError):  # not re-mounted yet
                    return False
                return True

            await eventually(serves_again, 15, "the store never served again after a restart")
            assert await backend.get(key) == b"after the restart"
            with pytest.raises(NotFoundError):  # nothing survives the master
                await backend.get(before)
        finally:
            await backend.close()
