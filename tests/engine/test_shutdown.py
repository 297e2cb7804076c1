"""Closing an extractor drains its writes and leaves no threads, descriptors or processes.

A process that starts and closes engines (tests, a supervisor, a notebook) must not
grow. The first cycle warms process-wide pools that outlive any engine by design
(Python's resource tracker, native thread pools of tokenizers and torch); the second
cycle must then leave the process exactly as it found it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from safetensors.torch import load_file

from service.config import Settings
from tests.engine.conftest import engine_settings, random_prompts, running

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def os_threads() -> set[int]:
    """Native threads too (ZMQ's I/O threads are invisible to ``threading``)."""
    return {t.id for t in psutil.Process().threads()}


def thread_names(ids: set[int]) -> list[str]:
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    names = []
    for tid in sorted(ids):
        try:
            names.append(python_names.get(tid) or Path(f"/proc/self/task/{tid}/comm").read_text())
        except OSError:
            names.append(f"{tid} (gone)")
    return names


def open_fds() -> dict[str, str]:
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, now closed
            links[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return links


def children() -> dict[int, str]:
    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            found[process.pid] = " ".join(process.cmdline())
        except psutil.Error as error:  # a zombie not yet reaped, or just gone
            found[process.pid] = type(error).__name__
    return found


async def cycle(settings: Settings, root: Path) -> None:
    async with running(settings) as extractor:
        results = await asyncio.gather(
            *(
                extractor.extract(p, extractor.request_params("s"))
                for p in random_prompts([30] * 8, seed=4)
            )
        )
    # close() returned: every object is complete on disk.
    for result in results:
        assert load_file(str(root / result.key))["hidden_states"].shape == result.shape


async def test_close_drains_and_leaks_nothing(
    model_dir: Any,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    settings = engine_settings(model_dir("llama"), str(tmp_path))
    await cycle(settings, tmp_path)
    threads, fds, kids = os_threads(), open_fds(), children()
    capfd.readouterr()
    await cycle(settings, tmp_path)
    out, err = capfd.readouterr()
    # The EngineCore exited by itself: vLLM kills it when its exit takes over 5 s, as
    # the interpreter's last heap scan made it (service/engine/lifeline.py) ...
    assert "force killing" not in out + err
    # ... and the frozen heap went unreported (no nanobind leak report).
    assert "leaked" not in out + err
    for _ in range(50):  # threads and processes wind down asynchronously
        gc.collect()
        if os_threads() <= threads and open_fds().keys() <= fds.keys() and children() == kids:
            break
        await asyncio.sleep(0.1)
    assert thread_names(os_threads() - threads) == []
    assert {fd: link for fd, link in open_fds().items() if fd not in fds} == {}
    assert {pid: cmd for pid, cmd in children().items() if pid not in kids} == {}
