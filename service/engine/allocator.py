"""Keep the writer's large, short-lived buffers from staying resident after they are freed.

The worker's copy-outs and encoded objects are megabytes each, allocated and freed by
many threads. glibc serves a large block with ``mmap`` and returns it to the system on
``free``, but each such free also raises its mmap threshold to the freed size (up to
32 MiB). After the first few objects, every later one comes from a per-thread arena,
whose freed memory mostly stays resident: the worker's RSS grew by about 500 MiB
against an in-flight ceiling of 128 MiB (``make bench``'s RSS row).

The first fix fixed the threshold at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``) for the
whole worker. That put the forward pass's own activations of a megabyte or more on
``mmap``/``munmap`` too, each with fresh page faults: the worker's forward threads
spent 2.0-2.8 s of every 10 in the kernel against 0.4 s on a stock engine
(benchmarks/peer_bench.py, docs/profile.md). The worker now keeps glibc's default
(dynamic) threshold, and the writer gives freed heap back with ``malloc_trim`` once a
share of its in-flight ceiling has been released, and once it has been idle for
``IDLE_TRIM_S`` (:class:`Trimmer`): the forward pass reuses its heap between trims,
and freed objects leave RSS within a bounded number of bytes. ``fix_mmap_threshold``
stays for callers who want the old behaviour in a process of their own.

glibc's dynamic thresholds left one more thing to chance: whether a CPU worker's
forward pass reuses its heap at all. The trim threshold follows the mmap threshold (twice
the largest block freed from ``mmap``), and a step that frees more than that at the top
of the heap gives it back to the system, for the next step to fault in again, page by
page. Which blocks a process happens to free first decides it: stock vLLM engines on the
2-core test machine took 0-4 thousand minor faults in one process and 380-690 thousand
in another for the same 64 prompts of 256 tokens, and ran up to 37% slower in the second
(docs/profile.md, "The stock engine's two speeds"). A CPU worker therefore fixes both
thresholds (:func:`steady_heap`, from the connector): blocks up to 32 MiB come from the
heap, and nothing is given back by itself; the :class:`Trimmer` alone gives back, in
bounded steps and when idle, as before.
"""

from __future__ import annotations

import logging

from service.glibc import glibc, malloc_trim

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20
#: glibc's largest mmap threshold on 64-bit hosts (half its 64 MiB arena heap): blocks
#: up to this size come from the heap under :func:`steady_heap`; larger ones are mapped.
STEADY_MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of a heap that glibc keeps under :func:`steady_heap` rather
#: than giving back by itself: a safety valve for a one-off spike, far above what a step
#: of the forward pass frees (its blocks above 32 MiB are mapped, not on the heap).
STEADY_TRIM_THRESHOLD = 1 << 30
#: :func:`steady_heap`'s two settings as glibc's ``GLIBC_TUNABLES`` environment variable,
#: for every process started with it (a stock vLLM engine included): as with
#: ``mallopt``, setting either threshold turns glibc's dynamic thresholds off.
STEADY_HEAP_TUNABLES = (
    f"glibc.malloc.mmap_threshold={STEADY_MMAP_THRESHOLD}"
    f":glibc.malloc.trim_threshold={STEADY_TRIM_THRESHOLD}"
)


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks of ``nbytes`` and more from ``mmap`` in this process, always.

    Returns False (and changes nothing) where the C library is not glibc.
    """
    return _mallopt(("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, nbytes))


def steady_heap() -> bool:
    """Fix glibc's mmap and trim thresholds in this process so that freed blocks up to
    :data:`STEADY_MMAP_THRESHOLD` stay on the heap for the next allocation, and no free
    gives memory back by itself (a :class:`Trimmer` does, when called).

    For a CPU worker: its forward pass allocates and frees the same blocks every step,
    and with glibc's dynamic thresholds whether it reuses them or faults them in again
    each step depended on the order of the process's first frees. Returns False where
    the C library is not glibc (nothing changed) or refuses a value (logged).
    """
    return _mallopt(
        ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD),
        ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD),
    )


def _mallopt(*options: tuple[str, int, int]) -> bool:
    """glibc's ``mallopt`` for each ``(name, parameter, value)`` in turn; False (with a
    warning) at the first it refuses, or where the C library is not glibc."""
    libc = glibc()
    if libc is None:
        return False
    for name, parameter, value in options:
        if libc.mallopt(parameter, value) != 1:
            log.warning("mallopt(%s, %d) was refused; the worker's RSS may differ", name, value)
            return False
    return True


#: The writer trims after releasing this share of its in-flight ceiling.
TRIM_SHARE = 4
#: ...and once it has stayed idle this long. Not at once: at one prompt in flight the
#: writer goes idle after every object, and a trim then (1-2 ms, and it hands back the
#: forward pass's free heap too, which the next forward faults back in) cost each
#: answer 5-10 ms at 256 tokens (docs/profile.md, "The answer's path").
IDLE_TRIM_S = 1.0


class Trimmer:
    """``malloc_trim(0)`` after every ``every`` bytes released (:meth:`released`), and
    on request (:meth:`trim`, the writer's idle timer); does nothing where the C
    library is not glibc."""

    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._since = 0
        self._trim = malloc_trim()
        #: Trims done (for tests and the bench's notes).
        self.count = 0
        #: Releases counted: the idle timer trims only if none came since it started.
        self.releases = 0

    def released(self, nbytes: int) -> bool:
        """Count ``nbytes`` released; trim if a share is due. True if trimmed."""
        self.releases += 1
        self._since += nbytes
        if self._since < self.every:
            return False
        return self.trim()

    def trim(self) -> bool:
        """Give freed heap back now; False where there is no ``malloc_trim``."""
        self._since = 0
        if self._trim is None:
            return False
        self._trim(0)
        self.count += 1
        return True
