"""Resident memory of this process's children (vLLM's EngineCore and its workers).

A thread samples the sum of their RSS (every 50 ms by default); the peak is what a
container's memory limit would see. The bench process itself is left out: it holds the
client side and, in the S3 runs, moto's server threads.
"""

from __future__ import annotations

import threading
from types import TracebackType

import psutil

MIB = 1024 * 1024


def children_rss(children: list[psutil.Process] | None = None) -> int:
    """Bytes resident in ``children`` (default: this process's descendants) now; a
    process that exits while being read counts as zero."""
    total = 0
    for child in psutil.Process().children(recursive=True) if children is None else children:
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue
    return total


class PeakRss:
    """``with PeakRss() as peak: ...`` then ``peak.bytes``: the highest sum seen.

    The children are listed once, on entry (an engine's processes live as long as it
    does); listing them walks every process on the machine, reading one is cheap.
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.bytes = 0
        self._children: list[psutil.Process] = []
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="hsx-bench-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, children_rss(self._children))
            if self._stop.wait(self._interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._children = psutil.Process().children(recursive=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, children_rss(self._children))
