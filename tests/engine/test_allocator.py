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


# In a thread (its own arena, like the writer's): after one large free has raised
# glibc's threshold, 64 blocks of 2 MiB are written and freed; prints the RSS growth
# that stayed (small live blocks keep the heap from shrinking by itself), then the
# growth left after the Trimmer's call, in MiB.
TRIM_PROBE = """
import ctypes, threading
from service.engine.allocator import Trimmer, _glibc

libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

pins = []

def churn():
    libc.free(libc.malloc(4 << 20))
    blocks = []
    for _ in range(64):
        blocks.append(libc.malloc(2 << 20))
        pins.append(libc.malloc(64))  # small live blocks between them, as in a real heap
    for b in blocks:
        ctypes.memset(b, 1, 2 << 20)
    for b in blocks:
        libc.free(b)

start = rss_mib()
thread = threading.Thread(target=churn)
thread.start()
thread.join()
kept = rss_mib() - start
trimmer = Trimmer(every=64 << 20)
assert not trimmer.released(32 << 20)  # not due yet
assert trimmer.released(32 << 20)  # a share released: due
print(round(kept), round(rss_mib() - start))
"""


def test_the_writer_trimmer_gives_freed_objects_back() -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True
    )
    kept, after = (int(v) for v in out.stdout.split())
    assert kept >= 64  # the default threshold keeps the freed blocks resident...
    assert after <= 16  # ...until the trim
