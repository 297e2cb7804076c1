"""Local-disk backend (``file:///abs/path`` or a plain path).

Publishing follows google/renameio: write a temp file in the destination directory,
fsync it, move it into place, fsync the directory. Temp names start with ``.hsx-tmp-``,
which no valid key segment can (keys start with a letter or digit), so the sweep that
removes stale temp files can never touch a published object.

Expiry (``put(..., expires_at=)``) is kept in a sidecar beside the object: a file named
``.hsx-exp-<object's name>@<inode>`` holding the unix seconds as ASCII, where ``inode``
is the object file's. A read stats the object and opens that tiny file (a failed open
for an object that never expires), so an expired object is a NotFoundError at once
without reading a byte of it; the sidecar's name cannot be a key segment, so listings
never show it and no key can overwrite it. Why not in the object: its safetensors
``__metadata__`` would need a header read per request and could not be changed later;
xattrs are not kept by every file system (tmpfs before 6.6, some NFS servers) nor by
copies; mtime is the listing's publish time.

Why the inode is in the name (issue 58, M2): a create-only put has one winner, the
``link()`` that takes the key, and only the winner may decide the object's expiry. A
writer records its expiry under its own temp file's inode *before* it links, so an
object is never visible without its expiry; a loser removes its own record and no one
else's (no other file holds its inode while its temp file exists, so no live record
shares its name). An object published without expiry has no record: its writer removes
a stale one its inode may carry from an earlier file before it links, and records of
other inodes are never read for it. The sidecar of one name and inode is removed
before that inode is let go (its file unlinked), so a new file reusing the number
cannot lose a record it just wrote.

``clean`` (the API's sweeper) walks the root: it removes expired objects with their
sidecars, and orphans older than ``stale_temp_s``: temp files, and sidecars whose
object is gone or is another file now. A sidecar of the older form ``.hsx-exp-<name>``
(no inode, before issue 58) is adopted by the object it was written for: one whose
bytes are not newer than it. A create-only put may take an expired object's key (it
is gone for readers); both it and the sweep move a file aside and check it is the one
judged (inode and mtime) before removing it, so a fresh object linked in between is
never removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from service.config import StorageSettings
from service.storage.base import (
    CHUNK,
    AlreadyExistsError,
    InvalidKeyError,
    NotFoundError,
    ObjectInfo,
    ObjectPage,
    ObjectReader,
    ObjectRef,
    Source,
    StorageError,
    StorageUnavailableError,
    Swept,
    ThreadedStorage,
)
from service.storage.expiry import is_expired
from service.storage.keys import is_key, is_segment, validate_key
from service.threads import named_pool

log = logging.getLogger(__name__)

TEMP_PREFIX = ".hsx-tmp-"
EXPIRY_PREFIX = ".hsx-exp-"
#: From this size up, an in-memory object is hashed on a thread of its own while it is
#: written (SHA-256 and the page-cache copy each release the GIL). One 16 MiB object on
#: the 2-core test machine: 20 ms to 11 ms from the first byte to fsync's return, the
#: same CPU; below 1 MiB the hop costs more than it saves.
PARALLEL_HASH_BYTES = 1 << 20


def expiry_path(path: Path, inode: int) -> Path:
    """The sidecar that holds the expiry of the file at ``path`` with inode ``inode``."""
    return path.with_name(f"{EXPIRY_PREFIX}{path.name}@{inode}")


def read_expiry(path: Path, inode: int | None = None) -> int | None:
    """The expiry recorded for the object at ``path`` (its inode, or the one it has now);
    None when it has none, is gone, or the record is unreadable: an object is never made
    to vanish by a damaged sidecar."""
    try:
        inode = path.stat().st_ino if inode is None else inode
        return int(expiry_path(path, inode).read_bytes())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def expiry_records(path: Path) -> list[Path]:
    """Every sidecar naming the object name of ``path``, whatever its inode (or of the
    older form without one), in name order."""
    try:
        names = os.listdir(path.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(path.with_name(n) for n in names if _sidecar_target(n)[0] == path.name)


def _sidecar_target(name: str) -> tuple[str | None, int | None]:
    """(object name, inode) a sidecar's file name records: inode None for the older form
    without one; (None, None) for a name that is no sidecar."""
    if not name.startswith(EXPIRY_PREFIX):
        return None, None
    target, at, inode = name.removeprefix(EXPIRY_PREFIX).rpartition("@")
    if at and inode.isdigit():
        return target, int(inode)
    return name.removeprefix(EXPIRY_PREFIX), None


def root_from_url(url: str) -> Path:
    """The directory a ``file://`` URL or plain path names, made absolute."""
    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must name a local path, got host {parts.netloc!r}")
        return Path(unquote(parts.path)).absolute()
    return Path(url).expanduser().absolute()


class LocalStorage(ThreadedStorage):
    """Objects as files under one root directory."""

    scheme = "file"

    def __init__(
        self,
        root: Path,
        *,
        create_only: bool = True,
        fsync: bool = True,
        io_threads: int = 8,
        stale_temp_s: float = 3600.0,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve(strict=True)
        self.create_only = create_only
        self.stale_temp_s = stale_temp_s
        self._fsync = fsync
        super().__init__(io_threads, "hsx-local")
        # Started lazily, from the I/O threads: they inherit their CPUs and nice value.
        self._hashers = named_pool(io_threads, "hsx-hash")

    @classmethod
    def from_settings(cls, url: str, settings: StorageSettings) -> LocalStorage:
        """Build from the storage URL and settings; sweeps stale temp files once."""
        storage = cls(
            root_from_url(url),
            create_only=settings.create_only,
            fsync=settings.local.fsync,
            io_threads=settings.io_threads,
            stale_temp_s=settings.local.stale_temp_s,
        )
        removed = storage.sweep()
        if removed:
            log.info("removed %d stale temp files under %s", removed, storage.root)
        return storage

    # -- keys and paths ---------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        """The file that holds ``key``; refuses keys that would leave the root.

        Beyond the syntax check, the resolved path must stay under the root, which
        catches symlinks inside the root that point out of it.
        """
        validate_key(key)
        path = self.root / key
        resolved = path.resolve(strict=False)
        if not resolved.is_relative_to(self.root) or resolved == self.root:
            raise InvalidKeyError("key resolves outside the storage root", key=key)
        return resolved

    def _file_for(self, key: str, operation: str) -> Path:
        """The regular file a read of ``key`` may open: NotFoundError when there is
        none of ours, which includes a symlink that leads out of the root (its target
        is not an object of this store) and a directory; InvalidKeyError for a key that
        is not one (syntax)."""
        validate_key(key)
        try:
            path = self.path_for(key)
        except InvalidKeyError:
            raise NotFoundError("no object under this key", operation=operation, key=key) from None
        try:
            found = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            found = None
        if found is None or not stat.S_ISREG(found.st_mode):
            raise NotFoundError("no object under this key", operation=operation, key=key)
        if is_expired(read_expiry(path, found.st_ino)):
            raise NotFoundError("no object under this key", operation=operation, key=key)
        return path

    def uri(self, key: str) -> str:
        return self.path_for(key).as_uri()

    # -- optional features ------------------------------------------------------------

    async def exists(self, key: str) -> bool:
        """A stat, not ``head``'s full-file checksum."""
        validate_key(key)
        try:
            await self._run(self._file_for, key, "head")
        except NotFoundError:
            return False
        return True

    async def open_read(self, key: str) -> ObjectReader:
        """Stream the file in pieces read on the backend's threads."""
        file = await self._run(self._open, key)
        return ObjectReader(os.fstat(file.fileno()).st_size, self._pieces(file))

    def _open(self, key: str) -> BinaryIO:
        path = self._file_for(key, "get")
        try:
            return open(path, "rb")  # closed by _pieces
        except OSError as exc:
            raise _os_error(exc, "get", key) from exc

    async def _pieces(self, file: BinaryIO) -> AsyncIterator[bytes]:
        try:
            while piece := await self._run(file.read, CHUNK):
                yield piece
        finally:
            file.close()

    async def close(self) -> None:
        await super().close()
        self._hashers.shutdown(wait=True)

    # -- blocking work ------------------------------------------------------------------

    def _publish(self, key: str, source: Source, expires_at: int | None) -> ObjectRef:
        final = self.path_for(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=final.parent)
        except OSError as exc:
            raise _os_error(exc, "put", key) from exc
        tmp, record, moved = Path(tmp_name), None, False
        try:
            digest = self._write_all(fd, source)
            record = self._record_expiry(tmp, final, expires_at)
            if self.create_only:
                self._remove_expired(final)  # its key is free: it is gone for readers
            self._move_into_place(tmp, final, key)
            moved = True
            self._sync_dir(final.parent)
        except BaseException as exc:
            # Our record and our file go on any error, the record first (module doc). If
            # the move happened but could not be made durable, the object goes too: a
            # key we do not report must not linger.
            for path in (record, tmp, final if moved else None):
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            if isinstance(exc, OSError):
                raise _os_error(exc, "put", key) from exc
            raise
        return ObjectRef(key, final.as_uri(), source.size, digest)

    def _record_expiry(self, tmp: Path, final: Path, expires_at: int | None) -> Path | None:
        """Record (atomically) the expiry of the object about to be linked from ``tmp``
        under ``tmp``'s inode, or, with none, remove a stale record of that inode (a
        crashed writer's whose file had the number before): the record it returns is
        this writer's alone (module doc)."""
        sidecar = expiry_path(final, tmp.stat().st_ino)
        if expires_at is None:
            with contextlib.suppress(FileNotFoundError):
                sidecar.unlink()
            return None
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=final.parent)
        try:
            self._write_all(fd, Source(data=str(int(expires_at)).encode()))
            os.replace(tmp_name, sidecar)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
        return sidecar

    def _remove_expired(self, final: Path, now: float | None = None) -> bool:
        """Remove the object at ``final`` with its sidecar if it has expired; whether it
        did (a fresh object another writer linked in between is never removed)."""
        try:
            judged = final.lstat()
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(judged.st_mode):
            return False
        if not is_expired(read_expiry(final, judged.st_ino), now):
            return False
        aside = _take_aside(final, judged)
        if aside is None:
            return False
        _drop(aside, final, judged.st_ino)
        return True

    def _write_all(self, fd: int, source: Source) -> str:
        """Write ``source`` to ``fd`` (fsync'd when configured, then closed); its SHA-256."""
        hashing = self._hash_aside(source)
        if hashing is not None:
            try:
                self._write_pieces(fd, source, None)
            except BaseException:
                # Never leave the hash reading buffers the caller may free once we
                # return; the write's error is the one to report.
                hashing.exception()
                raise
            return hashing.result()
        sha = hashlib.sha256()
        self._write_pieces(fd, source, sha)
        return sha.hexdigest()

    def _hash_aside(self, source: Source) -> Future[str] | None:
        """``source``'s SHA-256 started on a hash thread, or None: hash it while writing
        (small or file-backed sources, or a pool that no longer takes work, at exit)."""
        if source.path is not None or source.size < PARALLEL_HASH_BYTES:
            return None
        try:
            return self._hashers.submit(source.sha256)
        except RuntimeError:  # shut down (interpreter exit) or broken
            return None

    def _write_pieces(self, fd: int, source: Source, sha: hashlib._Hash | None) -> None:
        try:
            for piece in source.chunks():
                if sha is not None:
                    sha.update(piece)
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _move_into_place(self, tmp: Path, final: Path, key: str) -> None:
        if not self.create_only:
            os.replace(tmp, final)
            return
        # link() refuses an existing target atomically; rename() would overwrite it.
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise AlreadyExistsError("an object already exists under this key", key=key) from None
        tmp.unlink()

    def _sync_dir(self, directory: Path) -> None:
        if not self._fsync:
            return
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _get(self, key: str) -> bytes:
        path = self._file_for(key, "get")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise _os_error(exc, "get", key) from exc

    def _head(self, key: str) -> ObjectRef:
        path = self._file_for(key, "head")
        try:
            source = Source(path=path)
            return ObjectRef(key, path.as_uri(), source.size, source.sha256())
        except OSError as exc:
            raise _os_error(exc, "head", key) from exc

    def _delete(self, key: str) -> None:
        path = self.path_for(key)
        try:
            judged = path.lstat()
            if not stat.S_ISREG(judged.st_mode):
                path.unlink()  # not an object: refused as ever (a directory's EISDIR)
                return
            aside = _take_aside(path, judged)
            if aside is not None:  # else another delete or put came first
                _drop(aside, path, judged.st_ino)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _os_error(exc, "delete", key) from exc

    def _ping(self) -> None:
        if not self.root.is_dir() or not os.access(self.root, os.W_OK | os.X_OK):
            raise StorageUnavailableError(f"storage root {self.root} is not a writable directory")

    def _list(self, prefix: str, limit: int, after: str | None) -> ObjectPage:
        found = list(islice(self._walk(self.root, "", prefix, after), limit + 1))
        objects = []
        now = time.time()
        for key in found[:limit]:
            try:
                info = (self.root / key).stat()
            except FileNotFoundError:
                continue  # deleted since the walk saw it
            if is_expired(read_expiry(self.root / key, info.st_ino), now):
                continue  # gone for readers, even before the sweep
            created = datetime.fromtimestamp(info.st_mtime, UTC)
            objects.append(ObjectInfo(key, info.st_size, created))
        more = len(found) > limit
        return ObjectPage(tuple(objects), found[limit - 1] if more else None)

    def _walk(self, directory: Path, base: str, prefix: str, after: str | None) -> Iterator[str]:
        """Keys under ``directory`` in ascending key order, pruned by prefix and ``after``.

        A directory's key range is ``base + name + "/..."``: sorting entries by that
        (files by their own name) walks keys in the order S3 lists them. Only valid keys
        are listed (``validate_key``, the check every read applies): a stray file whose
        name no key can have (a space, a hidden name, a writer's temp file) is skipped,
        and so is a directory no key can lie under; symlinks are never followed.
        """
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        named = sorted(
            (e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in entries
        )
        for name, entry in named:
            if not is_segment(name.removesuffix("/")):
                continue  # temp files of writers in progress, stray names: never keys
            key = base + name
            if not (key.startswith(prefix) or prefix.startswith(key)):
                continue
            if after is not None and key <= after and not after.startswith(key):
                continue
            if name.endswith("/"):
                yield from self._walk(Path(entry.path), key, prefix, after)
            elif (
                entry.is_file(follow_symlinks=False)
                and key.startswith(prefix)
                and (after is None or key > after)
                and is_key(key)
            ):
                yield key

    async def clean(self) -> Swept:
        """Remove expired objects and orphans older than ``stale_temp_s`` (module doc)."""
        return await self._run(self._clean, time.time())

    def _clean(self, now: float) -> Swept:
        expired = orphan = 0
        stale = now - self.stale_temp_s
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                path = Path(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    if name.startswith(TEMP_PREFIX):
                        if path.lstat().st_mtime <= stale:
                            path.unlink()
                            orphan += 1
                    elif name.startswith(EXPIRY_PREFIX):
                        expired_now, orphaned = self._clean_one(path, now, stale)
                        expired, orphan = expired + expired_now, orphan + orphaned
        return Swept(expired=expired, orphan=orphan)

    def _clean_one(self, sidecar: Path, now: float, stale: float) -> tuple[int, int]:
        """(expired, orphan) removed for one sidecar: its object if expired, or the
        sidecar alone once it is older than the grace period and its object is gone or
        is another file (a writer between its record and its link keeps its record)."""
        name, inode = _sidecar_target(sidecar.name)
        if not name:  # ".hsx-exp-" alone names no object
            return 0, _remove_stale(sidecar, stale)
        target = sidecar.with_name(name)
        try:
            found: os.stat_result | None = target.lstat()
        except FileNotFoundError:
            found = None
        if inode is None:
            return 0, self._adopt(sidecar, target, found, stale)
        if found is None or found.st_ino != inode or not stat.S_ISREG(found.st_mode):
            return 0, _remove_stale(sidecar, stale)
        return int(self._remove_expired(target, now)), 0

    def _adopt(
        self, sidecar: Path, target: Path, found: os.stat_result | None, stale: float
    ) -> int:
        """Give a sidecar of the older form (no inode) to the object it was written for,
        one whose bytes are not newer than it; else it is an orphan (how many removed)."""
        judged = sidecar.lstat()
        if found is None or not stat.S_ISREG(found.st_mode):
            return _remove_stale(sidecar, stale)
        if found.st_mtime_ns > judged.st_mtime_ns:  # a dead writer's, before this object
            return _remove_stale(sidecar, stale)
        with contextlib.suppress(FileExistsError):  # a record of the object's own wins
            os.link(sidecar, expiry_path(target, found.st_ino))
        sidecar.unlink()
        return 0

    def sweep(self, older_than_s: float | None = None) -> int:
        """Remove temp files older than ``older_than_s`` (default: the configured age).

        Returns how many were removed. Published objects are never touched: their names
        cannot start with the temp prefix.
        """
        limit = time.time() - (self.stale_temp_s if older_than_s is None else older_than_s)
        removed = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    continue
                path = Path(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    if path.lstat().st_mtime <= limit:
                        path.unlink()
                        removed += 1
        return removed


def _take_aside(path: Path, judged: os.stat_result) -> Path | None:
    """Move the file at ``path`` to a temp name if it is still the one ``judged`` (its
    inode and mtime); its new path, or None (gone, or another file now, left in place).
    The file keeps its inode until the caller unlinks it."""
    aside = path.with_name(f"{TEMP_PREFIX}gone-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None  # someone else removed it first
    moved = aside.lstat()
    if (moved.st_ino, moved.st_mtime_ns) == (judged.st_ino, judged.st_mtime_ns):
        return aside
    with contextlib.suppress(FileExistsError):
        os.link(aside, path)  # a fresh file linked in between: put it back
    aside.unlink()
    return None


def _drop(aside: Path, path: Path, inode: int) -> None:
    """Remove an object moved aside from ``path``: its sidecar while the object still
    holds the inode the sidecar is named by, then the object."""
    with contextlib.suppress(FileNotFoundError):
        expiry_path(path, inode).unlink()
    aside.unlink()


def _remove_stale(path: Path, stale: float) -> int:
    """Remove the orphan at ``path`` once its mtime is at or before ``stale``; 1 if it
    did. Moved aside and checked first, like an object: a writer may have just rewritten
    it."""
    judged = path.lstat()
    if judged.st_mtime > stale:
        return 0
    aside = _take_aside(path, judged)
    if aside is None:
        return 0
    aside.unlink()
    return 1


def _os_error(exc: OSError, operation: str, key: str) -> StorageError:
    if isinstance(exc, FileNotFoundError) and operation in ("get", "head"):
        return NotFoundError("no object under this key", operation=operation, key=key)
    reason = errno.errorcode.get(exc.errno or 0, "OSError")
    return StorageError(
        f"local {operation} failed: {reason}: {exc.strerror or exc}", operation=operation, key=key
    )
