"""The worker's allocator settings: object-sized blocks go back to the system (the fixed
mmap threshold, the writer's Trimmer), and a CPU worker's forward pass reuses its heap
from step to step (``steady_heap``).

Each case runs in a fresh interpreter, since the threshold is process-wide and glibc's
dynamic adjustment depends on what the process freed before.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.glibc import glibc as _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")

# Frees a 4 MiB block (which raises glibc's dynamic threshold to 4 MiB), then allocates
# 2 MiB and prints how many bytes of it mallinfo2 counts as mmapped.
PROBE = """
import ctypes, sys
from service.engine.allocator import fix_mmap_threshold
from service.glibc import glibc as _glibc

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
import ctypes, sys, threading
from service.engine.allocator import Trimmer, steady_heap
from service.glibc import glibc as _glibc

if sys.argv[1] == "steady":
    assert steady_heap()

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


@pytest.mark.parametrize("mode", ["default", "steady"])
def test_the_writer_trimmer_gives_freed_objects_back(mode: str) -> None:
    # Under steady_heap nothing is given back by itself: the Trimmer still does it.
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE, mode], capture_output=True, text=True, check=True
    )
    kept, after = (int(v) for v in out.stdout.split())
    assert kept >= 64  # the default threshold keeps the freed blocks resident...
    assert after <= 16  # ...until the trim


# A forward step's shape: three 24 MiB blocks alive at once, written, then freed. glibc's
# dynamic thresholds (trim at twice the largest block freed from mmap, 48 MiB) give the
# 72 MiB back at every step's end, and the next step faults it in again. Prints the
# minor faults of five steps after three warm-up steps.
STEP_PROBE = """
import ctypes, resource, sys
from service.engine.allocator import steady_heap
from service.glibc import glibc as _glibc

libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "steady":
    assert steady_heap()

def step():
    blocks = [libc.malloc(24 << 20) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, 24 << 20)
    for block in blocks:
        libc.free(block)

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_five_steps(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run(
        [sys.executable, "-c", STEP_PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env=None if env is None else {**os.environ, **env},
    )
    return int(out.stdout)


def test_by_default_every_step_faults_its_blocks_in_again() -> None:
    # Why steady_heap exists: 5 steps x 72 MiB in 4 KiB pages, minus the odd reuse.
    assert _faults_of_five_steps("default") >= 5 * (72 << 20) // 4096 // 2


def test_a_steady_heap_reuses_the_blocks_of_the_step_before() -> None:
    assert _faults_of_five_steps("steady") < 1000  # the interpreter's own, not the blocks


def test_the_steady_heap_tunables_steady_a_process_that_never_calls_mallopt() -> None:
    # What the peer bench gives every side's processes, a stock vLLM engine's included.
    from service.engine.allocator import STEADY_HEAP_TUNABLES

    env = {"GLIBC_TUNABLES": STEADY_HEAP_TUNABLES}
    assert _faults_of_five_steps("default", env) < 1000
