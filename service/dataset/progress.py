"""The run's counters and their display (rich on a terminal, a log line elsewhere)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    """What a run has decided; ``*_before`` came from the manifest of earlier runs."""

    expected: int
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    tokens: int = 0
    bytes: int = 0
    ok_before: int = 0
    bytes_before: int = 0
    decided_before: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def decided(self) -> int:
        return self.ok + self.failed + self.skipped

    def rates(self) -> tuple[float, float]:
        """Samples and tokens per second in this session."""
        elapsed = max(time.monotonic() - self.started, 1e-6)
        return (self.ok - self.ok_before) / elapsed, self.tokens / elapsed

    def eta_s(self) -> float | None:
        elapsed = time.monotonic() - self.started
        done_now = self.decided - self.decided_before
        if done_now <= 0 or elapsed <= 0:
            return None
        return max(self.expected - self.decided, 0) / (done_now / elapsed)

    def projected_bytes(self) -> int | None:
        """Total object bytes once every row is done, at the mean size so far."""
        if self.ok == 0:
            return None
        return int(self.bytes / self.ok * max(self.expected - self.failed - self.skipped, 0))

    def line(self) -> str:
        samples, tokens = self.rates()
        eta, total = self.eta_s(), self.projected_bytes()
        return (
            f"done {self.ok} failed {self.failed} skipped {self.skipped} of ~{self.expected} | "
            f"{samples:.1f} samples/s {tokens:,.0f} tok/s | {_size(self.bytes)} written | "
            f"ETA {_duration(eta)} | projected {_size(total)}"
        )


def _size(value: int | None) -> str:
    if value is None:
        return "?"
    size = float(value)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Display:
    """A live line on a terminal; elsewhere one line every ``every_s`` on stderr."""

    def __init__(self, counters: Counters, enabled: bool, every_s: float = 10.0) -> None:
        self.counters, self.every_s = counters, every_s
        self.enabled = enabled
        self.live: Any = None
        self.last = 0.0
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(stderr=True), refresh_per_second=4)
            self.live.start()

    def update(self) -> None:
        if not self.enabled:
            return
        if self.live is not None:
            self.live.update(self.counters.line())
        elif time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            print(self.counters.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self.counters.line())
            self.live.stop()
        elif self.enabled:
            print(self.counters.line(), file=sys.stderr, flush=True)
