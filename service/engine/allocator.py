"""Keep the writer's large, short-lived buffers from staying resident after they are freed.

The worker's copy-outs and encoded objects are megabytes each, allocated and freed by
many threads. glibc serves a large block with ``mmap`` and returns it to the system on
``free``, but each such free also raises its mmap threshold to the freed size (up to
32 MiB). After the first few objects, every later one comes from a per-thread arena,
whose freed memory mostly stays resident: the worker's RSS grew by about 500 MiB
against an in-flight ceiling of 128 MiB (``make bench``'s RSS row). Fixing
the threshold at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, which also turns off the
dynamic adjustment) keeps every object-sized block on ``mmap``, so what is freed goes
back at once; the price, one ``mmap``/``munmap`` pair per megabyte-sized block, is small
beside writing that block to storage.

Setting ``MALLOC_MMAP_THRESHOLD_`` in the environment does the same, but only for a
process started with it; vLLM's engine processes inherit the server's environment, so
the worker sets it for itself instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 1 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks of ``nbytes`` and more from ``mmap`` in this process, always.

    Returns False (and changes nothing) where the C library is not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; RSS may stay high", nbytes)
        return False
    return True


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl does not)
    except (OSError, AttributeError):
        return None
    return libc
