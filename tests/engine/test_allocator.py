"""The worker's fixed mmap threshold: object-sized blocks go back to the system on free.

Each case runs in a fresh interpreter, since the threshold is process-wide and glibc's
dynamic adjustment depends on what the process freed before.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.engine.allocator import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")

# Frees a 4 MiB block (which raises glibc's dynamic threshold to 4 MiB), then allocates
# 2 MiB and prints how many bytes of it mallinfo2 counts as mmapped.
PROBE = """
import ctypes, sys
from service.engine.allocator import _glibc, fix_mmap_threshold

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = _glibc()
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


def _mmapped_bytes_of_a_2_mib_block(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def test_by_default_glibc_raises_its_threshold_and_keeps_the_next_block_in_an_arena() -> None:
    # Why the fix exists: after one large free, a 2 MiB block is no longer mmapped.
    assert _mmapped_bytes_of_a_2_mib_block("default") == 0


def test_with_the_fixed_threshold_every_object_sized_block_is_mmapped() -> None:
    assert _mmapped_bytes_of_a_2_mib_block("fixed") >= 2 << 20
