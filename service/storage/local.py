"""Local-disk backend (``file:///abs/path`` or a plain path).

Publishing follows google/renameio: write a temp file in the destination directory,
fsync it, move it into place, fsync the directory. Temp names start with ``.hsx-tmp-``,
which no valid key segment can (keys start with a letter or digit), so the sweep that
removes stale temp files can never touch a published object.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
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
    ThreadedStorage,
)
from service.storage.keys import is_key, is_segment, validate_key

log = logging.getLogger(__name__)

TEMP_PREFIX = ".hsx-tmp-"


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
        if not path.is_file():
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

    # -- blocking work ------------------------------------------------------------------

    def _publish(self, key: str, source: Source) -> ObjectRef:
        final = self.path_for(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=final.parent)
        except OSError as exc:
            raise _os_error(exc, "put", key) from exc
        tmp, moved = Path(tmp_name), False
        try:
            digest = self._write_all(fd, source)
            self._move_into_place(tmp, final, key)
            moved = True
            self._sync_dir(final.parent)
        except BaseException as exc:
            # The temp file goes on any error. If the move happened but could not be made
            # durable, the object goes too: a key we do not report must not linger.
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            if moved:
                with contextlib.suppress(FileNotFoundError):
                    final.unlink()
            if isinstance(exc, OSError):
                raise _os_error(exc, "put", key) from exc
            raise
        return ObjectRef(key, final.as_uri(), source.size, digest)

    def _write_all(self, fd: int, source: Source) -> str:
        digest = hashlib.sha256()
        try:
            for piece in source.chunks():
                digest.update(piece)
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return digest.hexdigest()

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
        try:
            self.path_for(key).unlink()
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
        for key in found[:limit]:
            try:
                stat = (self.root / key).stat()
            except FileNotFoundError:
                continue  # deleted since the walk saw it
            created = datetime.fromtimestamp(stat.st_mtime, UTC)
            objects.append(ObjectInfo(key, stat.st_size, created))
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


def _os_error(exc: OSError, operation: str, key: str) -> StorageError:
    if isinstance(exc, FileNotFoundError) and operation in ("get", "head"):
        return NotFoundError("no object under this key", operation=operation, key=key)
    reason = errno.errorcode.get(exc.errno or 0, "OSError")
    return StorageError(
        f"local {operation} failed: {reason}: {exc.strerror or exc}", operation=operation, key=key
    )
