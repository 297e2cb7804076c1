"""Thread pools whose threads carry their names to the OS (service/threads.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from service.threads import named_pool


def os_name() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc thread names")
def test_pool_threads_carry_their_names_and_run_the_initializer_after() -> None:
    ran: list[str] = []
    with named_pool(2, "hsx-probe", lambda: ran.append(os_name())) as pool:
        names = {pool.submit(os_name).result() for _ in range(4)}
    assert names
    assert names <= {"hsx-probe_0", "hsx-probe_1"}
    assert ran
    assert set(ran) <= {"hsx-probe_0", "hsx-probe_1"}


def test_without_setproctitle_the_pool_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    # A name is for tools: a missing library must not break the pool's start-up hook.
    monkeypatch.setitem(sys.modules, "setproctitle", None)  # import raises ImportError
    with named_pool(1, "hsx-plain") as pool:
        assert pool.submit(lambda: 41 + 1).result() == 42
