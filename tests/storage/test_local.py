"""Local-disk backend: the contract, atomic publish under faults, the sweep, key safety."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from service.config import LocalStorageSettings, StorageSettings
from service.metrics import StorageMetrics
from service.storage import (
    AlreadyExistsError,
    InvalidKeyError,
    NotFoundError,
    StorageError,
    open_backend,
    open_storage,
)
from service.storage.base import Source, Swept
from service.storage.local import (
    EXPIRY_PREFIX,
    PARALLEL_HASH_BYTES,
    TEMP_PREFIX,
    LocalStorage,
    expiry_path,
    expiry_records,
    read_expiry,
    root_from_url,
)
from tests.storage.contract import Plant, StorageContract, fresh_key, payload
from tests.support.processes import wait_until


class TestLocalContract(StorageContract):
    @pytest.fixture
    async def storage(self, tmp_path: Path) -> AsyncIterator[LocalStorage]:
        backend = open_backend(StorageSettings(url=(tmp_path / "objects").as_uri()))
        assert isinstance(backend, LocalStorage)
        yield backend
        await backend.close()

    @pytest.fixture
    def plant(self, storage: LocalStorage) -> Plant:
        return planter(storage.root)


class TestInstrumentedLocalContract(StorageContract):
    """The metrics wrapper keeps every guarantee of the backend it wraps."""

    @pytest.fixture
    async def storage(self, tmp_path: Path) -> AsyncIterator[Any]:
        metrics = StorageMetrics(CollectorRegistry(), "file")
        backend = open_storage(StorageSettings(url=str(tmp_path / "objects")), metrics)
        yield backend
        await backend.close()

    @pytest.fixture
    def plant(self, storage: Any) -> Plant:
        return planter(storage.inner.root)


def planter(root: Path) -> Plant:
    """Files written under ``root`` by something other than hsx."""

    async def plant(name: str, data: bytes) -> None:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return plant


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[LocalStorage]:
    backend = LocalStorage(tmp_path / "objects")
    yield backend
    await backend.close()


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def fail_for_paths_under(
    root: Path, real: Callable[..., Any], err: int, *, fd_arg: bool = True
) -> Callable[..., Any]:
    """Wrap an os function so it fails with ``err`` only on descriptors under ``root``.

    Only our backend's files fail; pytest's own I/O goes through untouched.
    """

    def fake(fd: int, *args: Any) -> Any:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(str(root)):
            raise OSError(err, os.strerror(err))
        return real(fd, *args)

    return fake


@pytest.mark.parametrize(
    ("function", "err"),
    [("write", errno.ENOSPC), ("write", errno.EIO), ("fsync", errno.EIO), ("fsync", errno.ENOSPC)],
)
async def test_io_error_leaves_no_object_and_no_temp_file(
    local: LocalStorage, monkeypatch: pytest.MonkeyPatch, function: str, err: int
) -> None:
    monkeypatch.setattr(os, function, fail_for_paths_under(local.root, getattr(os, function), err))
    key = fresh_key()
    with pytest.raises(StorageError, match=errno.errorcode[err]) as info:
        await local.put(key, payload(3 * 1024 * 1024))
    assert info.value.key == key
    assert files_under(local.root) == []
    monkeypatch.undo()
    await local.put(key, b"works again")
    assert await local.get(key) == b"works again"


async def test_directory_fsync_failure_unpublishes(
    local: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the rename cannot be made durable, the key is not reported and not left behind."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "EIO")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError, match="EIO"):
        await local.put(fresh_key(), b"data")
    assert files_under(local.root) == []


KILLED_WRITER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path
    from service.storage.local import LocalStorage

    def die(*_args):
        os.kill(os.getpid(), signal.SIGKILL)

    storage = LocalStorage(Path(sys.argv[1]))
    os.link = os.replace = die  # killed between the write and the publish
    asyncio.run(storage.put(sys.argv[2], b"x" * 100_000))
    """
)


async def test_killed_writer_leaves_no_object_and_sweep_removes_temp(tmp_path: Path) -> None:
    root = tmp_path / "objects"
    survivor = LocalStorage(root)
    kept = fresh_key()
    await survivor.put(kept, b"kept")
    key = fresh_key()
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(root), key], check=False)
    assert proc.returncode == -9
    assert not survivor.path_for(key).exists()
    temps = [p for p in files_under(root) if p.name.startswith(TEMP_PREFIX)]
    assert len(temps) == 1
    assert temps[0].stat().st_size == 100_000
    assert survivor.sweep(older_than_s=3600) == 0  # too young: may be a live writer
    assert survivor.sweep(older_than_s=0) == 1
    assert files_under(root) == [survivor.path_for(kept)]
    assert survivor.path_for(kept).read_bytes() == b"kept"


def test_open_storage_sweeps_stale_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "objects"
    (root / "hsx").mkdir(parents=True)
    stale = root / "hsx" / f"{TEMP_PREFIX}abc"
    stale.write_bytes(b"partial")
    os.utime(stale, (0, 0))
    young = root / "hsx" / f"{TEMP_PREFIX}def"
    young.write_bytes(b"in progress")
    open_storage(StorageSettings(url=str(root), local=LocalStorageSettings(stale_temp_s=60)))
    assert not stale.exists()
    assert young.exists()


def test_symlink_pointing_out_of_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    storage = LocalStorage(tmp_path / "objects")
    (storage.root / "escape").symlink_to(outside)
    (storage.root / "inner").symlink_to(storage.root)
    with pytest.raises(InvalidKeyError, match="outside"):
        storage.path_for("escape/x.safetensors")
    assert storage.path_for("inner/x.safetensors") == storage.root / "x.safetensors"


async def test_reads_through_a_symlink_out_of_root_find_nothing(tmp_path: Path) -> None:
    # Issue 26, finding 11: a read of a well-formed key whose path leads out of the root
    # was an InvalidKeyError (a storage error: 502 over HTTP). No object of this store
    # is there: reads find nothing, writes are still refused, the target is untouched.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(b"not ours")
    storage = LocalStorage(tmp_path / "objects")
    (storage.root / "escape").symlink_to(outside)
    (storage.root / "dir.safetensors").mkdir()  # a directory is not an object either
    try:
        for key in ("escape/x.safetensors", "dir.safetensors"):
            assert not await storage.exists(key)
            with pytest.raises(NotFoundError):
                await storage.get(key)
            with pytest.raises(NotFoundError):
                await storage.head(key)
            with pytest.raises(NotFoundError):
                await storage.open_read(key)
        with pytest.raises(InvalidKeyError, match="outside"):
            await storage.put("escape/x.safetensors", b"overwrite")
        assert (outside / "x.safetensors").read_bytes() == b"not ours"
        assert (await storage.list("", limit=10)).objects == ()  # neither is listed
    finally:
        await storage.close()


def test_root_from_url_accepts_file_urls_and_paths(tmp_path: Path) -> None:
    assert root_from_url(tmp_path.as_uri()) == tmp_path
    assert root_from_url(str(tmp_path)) == tmp_path
    assert root_from_url("rel/dir") == Path.cwd() / "rel/dir"
    with pytest.raises(ValueError, match="host"):
        root_from_url("file://example.com/x")


_ROOT = Path(tempfile.mkdtemp(prefix="hsx-prop-")) / "root"
_PROPERTY_STORAGE = LocalStorage(_ROOT)
(_PROPERTY_STORAGE.root / "loop").symlink_to(_PROPERTY_STORAGE.root.parent)

_SEGMENTS = st.sampled_from(
    ["..", ".", "", "a", "b.c", "..a", "a..", "loop", "~", "\\", "\x00", "é", "a b", "%2e%2e"]
)
_KEYS = st.one_of(
    st.lists(_SEGMENTS, min_size=1, max_size=6).map("/".join),
    st.text(alphabet="ab./\\\x00-_=é~:%", max_size=40),
    st.builds(lambda s: "/" + s, st.text(max_size=20)),
)


@settings(max_examples=500, deadline=None)
@given(_KEYS)
def test_no_accepted_key_resolves_outside_root(key: str) -> None:
    root = _PROPERTY_STORAGE.root
    try:
        path = _PROPERTY_STORAGE.path_for(key)
    except InvalidKeyError:
        return
    assert path.is_relative_to(root)
    assert path != root
    assert os.path.realpath(path).startswith(str(root) + os.sep)


# -- expiry: the sidecar and the sweep (issue 29) ---------------------------------------


async def test_expired_object_is_404_then_gone_from_disk_after_the_sweep(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "objects", fsync=False)
    key, kept = fresh_key(), fresh_key()
    await storage.put(key, payload(5000), expires_at=int(time.time()) + 1)
    await storage.put(kept, b"kept")
    path = storage.path_for(key)
    (sidecar,) = expiry_records(path)  # beside the object, named by its inode
    assert sidecar == expiry_path(path, path.stat().st_ino)
    assert sidecar.read_bytes().isdigit()
    assert await storage.get(key) == payload(5000)
    wait_until(lambda: not path_is_served(storage, key), 5, "object did not expire")
    assert path.exists()  # invisible before the sweep removes its bytes
    assert await storage.clean() == Swept(expired=1, orphan=0)
    assert files_under(storage.root) == [storage.path_for(kept)]
    assert await storage.clean() == Swept()
    await storage.close()


def path_is_served(storage: LocalStorage, key: str) -> bool:
    try:
        storage._file_for(key, "get")
    except NotFoundError:
        return False
    return True


async def test_sweep_removes_orphans_past_the_grace_period_only(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "objects", fsync=False, stale_temp_s=60)
    live = fresh_key()
    await storage.put(live, b"live", expires_at=int(time.time()) + 3600)
    path = storage.path_for(live)
    day = path.parent
    old_temp, young_temp = day / f"{TEMP_PREFIX}old", day / f"{TEMP_PREFIX}young"
    old_sidecar = expiry_path(day / "gone.safetensors", 7)  # its object was never linked
    young_sidecar = expiry_path(day / "coming.safetensors", 8)  # a writer about to link
    other_file = expiry_path(path, path.stat().st_ino + 1)  # an earlier file's, replaced
    nameless = day / EXPIRY_PREFIX  # names no object at all
    old = (old_temp, old_sidecar, other_file, nameless)
    for orphan in (*old, young_temp, young_sidecar):
        orphan.write_bytes(b"1")
    for orphan in old:
        os.utime(orphan, (0, 0))
    assert await storage.clean() == Swept(expired=0, orphan=4)
    assert [p.exists() for p in old] == [False] * 4
    assert [p.exists() for p in (young_temp, young_sidecar)] == [True, True]
    assert await storage.get(live) == b"live"
    assert expiry_records(path) == [expiry_path(path, path.stat().st_ino)]  # its own stays
    await storage.close()


async def test_a_stale_record_of_another_file_does_not_expire_a_new_object(
    tmp_path: Path,
) -> None:
    # A writer that died between its record and its link leaves the record; the next
    # object under that key, put without expiry, must not inherit it.
    storage = LocalStorage(tmp_path / "objects", fsync=False)
    key = fresh_key()
    path = storage.path_for(key)
    path.parent.mkdir(parents=True)
    stale = [expiry_path(path, 12345), path.with_name(EXPIRY_PREFIX + path.name)]
    for record in stale:
        record.write_bytes(b"1")  # expired long ago
    await storage.put(key, b"new")
    assert await storage.get(key) == b"new"
    assert [o.key for o in (await storage.list("hsx/")).objects] == [key]
    await storage.close()


async def test_a_stale_record_of_the_writers_own_inode_is_removed_before_it_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # File systems reuse inode numbers: a crashed writer's record may name the inode
    # the next writer's temp file gets. Hand the writer such a temp file.
    storage = LocalStorage(tmp_path / "objects", fsync=False)
    key = fresh_key()
    path = storage.path_for(key)
    path.parent.mkdir(parents=True)
    fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
    inode = os.fstat(fd).st_ino
    expiry_path(path, inode).write_bytes(b"1")  # expired long ago
    real, handed = tempfile.mkstemp, [(fd, name)]
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: handed.pop() if handed else real(**kw))
    await storage.put(key, b"new")
    assert path.stat().st_ino == inode  # the writer's file is the one the record named
    assert await storage.get(key) == b"new"
    assert expiry_records(path) == []
    await storage.close()


async def test_the_loser_of_a_create_only_put_leaves_the_winners_expiry_alone(
    tmp_path: Path,
) -> None:
    storage = LocalStorage(tmp_path / "objects", fsync=False)
    soon = int(time.time()) + 3600
    expiring, forever = fresh_key(), fresh_key()
    await storage.put(expiring, b"first", expires_at=soon)
    with pytest.raises(AlreadyExistsError):
        await storage.put(expiring, b"second")  # without expiry: must not remove it
    with pytest.raises(AlreadyExistsError):
        await storage.put(expiring, b"third", expires_at=soon + 60)  # nor rewrite it
    await storage.put(forever, b"first")
    with pytest.raises(AlreadyExistsError):
        await storage.put(forever, b"second", expires_at=int(time.time()) - 1)
    assert read_expiry(storage.path_for(expiring)) == soon
    assert expiry_records(storage.path_for(forever)) == []
    assert [await storage.get(k) for k in (expiring, forever)] == [b"first", b"first"]
    assert files_under(storage.root) == sorted(
        [
            storage.path_for(expiring),
            storage.path_for(forever),
            *expiry_records(storage.path_for(expiring)),
        ]
    )
    await storage.close()


async def test_a_record_of_the_older_form_is_adopted_by_its_object(tmp_path: Path) -> None:
    # Before issue 58 a sidecar was ``.hsx-exp-<name>``, written after the object's
    # bytes: the sweep gives it to that object, and an older one (a dead writer's,
    # before this object) to none.
    storage = LocalStorage(tmp_path / "objects", fsync=False, stale_temp_s=60)
    adopted, kept = fresh_key(), fresh_key()
    for key in (adopted, kept):
        await storage.put(key, b"data")
    legacy = storage.path_for(adopted).with_name(EXPIRY_PREFIX + Path(adopted).name)
    legacy.write_bytes(str(int(time.time()) - 1).encode())
    older = storage.path_for(kept).with_name(EXPIRY_PREFIX + Path(kept).name)
    older.write_bytes(b"1")
    os.utime(older, (0, 0))
    assert await storage.clean() == Swept(expired=0, orphan=1)
    assert not await storage.exists(adopted)  # its expiry holds again
    assert await storage.get(kept) == b"data"
    assert await storage.clean() == Swept(expired=1, orphan=0)
    assert files_under(storage.root) == [storage.path_for(kept)]
    await storage.close()


async def test_a_damaged_sidecar_never_hides_an_object(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "objects", fsync=False)
    key = fresh_key()
    await storage.put(key, b"data", expires_at=int(time.time()) - 10)
    path = storage.path_for(key)
    expiry_path(path, path.stat().st_ino).write_bytes(b"not a time")
    assert await storage.get(key) == b"data"
    assert [o.key for o in (await storage.list("hsx/")).objects] == [key]
    await storage.close()


async def test_delete_removes_the_sidecar_too(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "objects", fsync=False)
    key = fresh_key()
    await storage.put(key, b"data", expires_at=int(time.time()) + 3600)
    await storage.delete(key)
    assert files_under(storage.root) == []
    await storage.close()


async def test_large_objects_hash_on_their_own_thread_and_fall_back_when_it_is_gone(
    local: LocalStorage,
) -> None:
    # From PARALLEL_HASH_BYTES up the SHA-256 runs on a hash thread beside the write; a
    # pool that takes no more work (interpreter exit) leaves the put to hash inline.
    pieces = [b"head", payload(PARALLEL_HASH_BYTES + 5, seed=8), payload(999, seed=9)]
    whole = b"".join(pieces)
    ref = await local.put(fresh_key(), pieces)
    assert (ref.size, ref.sha256) == (len(whole), hashlib.sha256(whole).hexdigest())
    hash_threads = [t for t in threading.enumerate() if t.name.startswith("hsx-hash")]
    assert hash_threads  # the parallel path ran
    local._hashers.shutdown(wait=True)
    key = fresh_key()
    ref = await local.put(key, pieces)
    assert ref.sha256 == hashlib.sha256(whole).hexdigest()
    assert await local.get(key) == whole
    assert [p.name for p in local.root.rglob(f"{TEMP_PREFIX}*")] == []


async def test_a_file_backed_source_is_hashed_inline_and_written_whole(
    local: LocalStorage, tmp_path: Path
) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(payload(2 * PARALLEL_HASH_BYTES, seed=10))
    digest = local._write_all(
        os.open(tmp_path / "copy.bin", os.O_WRONLY | os.O_CREAT), Source(path=source)
    )
    assert digest == hashlib.sha256(source.read_bytes()).hexdigest()
    assert (tmp_path / "copy.bin").read_bytes() == source.read_bytes()
