"""What the experiments share beyond ``benchmarks.common``: their command line's runner."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from benchmarks.common import Row, table_line, timed


def print_rows(run: Callable[..., Awaitable[list[Row]]], quick: bool, prefix: str) -> list[Row]:
    """An experiment's ``run(scratch, timed, quick=...)`` in a scratch directory of its
    own (``prefix``), each row printed as a line of a benchmarks.md table."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        rows = asyncio.run(run(Path(scratch), timed, quick=quick))
    for row in rows:
        print(table_line(row))
    return rows
