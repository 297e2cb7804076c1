"""The process's C library, where it is glibc: the one ctypes binding hsx makes.

Both processes give freed heap back to the system with glibc's ``malloc_trim`` (the
worker's writer, ``service.engine.allocator``; the API after a large request body,
``service.api.bounded_route``), and the worker tunes ``mallopt``. Elsewhere (musl, macOS)
there is nothing to call, and callers do nothing. Imports nothing of ours, so the API
process can use it without loading the engine's code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


def glibc() -> ctypes.CDLL | None:
    """glibc; None where the C library is not glibc (or cannot be found)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl does not)
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)``, looked up once, which hands free heap at the top of
    every arena back to the system; None where the C library is not glibc."""
    libc = glibc()
    return None if libc is None else libc.malloc_trim
