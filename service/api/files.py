"""Serve a local file from one open descriptor, so a concurrent delete cannot cut it.

``FileResponse`` stats the path, sends the headers, then opens it: a DELETE in between
left a 200 with a Content-Length and no body. Here the file is opened first; a missing
file is a 404, and an opened one is sent whole even if it is unlinked meanwhile.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi.responses import StreamingResponse

CHUNK_BYTES = 1 << 20


async def file_response(path: Path, media_type: str, filename: str) -> StreamingResponse | None:
    """The whole file at ``path`` as a response, or None if it does not exist."""
    try:
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        size = os.fstat(fd).st_size
    except OSError:
        os.close(fd)
        raise
    headers = {
        "content-length": str(size),
        "content-disposition": f'attachment; filename="{filename}"',
    }
    return StreamingResponse(_chunks(fd, size), media_type=media_type, headers=headers)


async def _chunks(fd: int, size: int) -> AsyncIterator[bytes]:
    """``size`` bytes from ``fd``, then close it (also when the client goes away)."""
    try:
        sent = 0
        while sent < size:
            data = await asyncio.to_thread(os.pread, fd, min(CHUNK_BYTES, size - sent), sent)
            if not data:  # cannot happen for a published (immutable) object
                raise OSError(f"file shrank to {sent} of {size} bytes")
            sent += len(data)
            yield data
    finally:
        os.close(fd)
