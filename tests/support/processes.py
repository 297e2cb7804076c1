"""Processes for end-to-end tests: a free port, polling waits, and ``hsx serve``.

One way to start the real command (``python -m service serve``) in a directory of the
test's own, with an environment of the test's own (no ``HSX_`` variable leaks in from
the machine), wait until it answers ``/ready``, and never leave it behind.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

from service.demo_model import DEMO_DIR
from service.engine.hugepages import VARIABLE as HUGE_PAGES_VARIABLE

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    condition: Callable[[], T | None],
    timeout_s: float,
    message: str,
    *,
    interval_s: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``condition()`` until it returns something truthy, and return that; fail
    with ``message`` after ``timeout_s``. Exceptions of the ``ignore`` types count as
    "not yet" (a server not listening yet: ``httpx.TransportError``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = condition()
        except ignore:
            found = None
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (after {timeout_s:g} s)")
        time.sleep(interval_s)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    """Until ``url``'s ``/ready`` answers 200; fails at once, with the end of ``log``,
    if ``proc`` exits first."""

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited during start-up:\n{_tail(log)}")
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200

    wait_until(ready, timeout_s, "the server never became ready", interval_s=0.2,
               ignore=(httpx.TransportError,))  # fmt: skip


def hsx_env(env: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without ``HSX_`` variables, plus ``env``: hsx's own
    defaults (the demo model, CPU memory settings) apply to whatever ``env`` leaves out."""
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("HSX_") and k not in SET_BY_HSX
    }
    return {**clean, **env}


#: Variables hsx sets in its own process's environment when an engine starts there
#: (``Extractor.start``: torch's huge-page switch): a process under test must not inherit
#: them from a test process that ran an engine, or it would not show its own defaults.
SET_BY_HSX = (HUGE_PAGES_VARIABLE,)

#: Variables ``make test`` sets for the suite's processes alone (the Makefile's
#: ``SUITE_ENV``): a README command under test runs without them, as a user's would.
SUITE_ONLY = ("OMP_WAIT_POLICY",)

#: The command users run, as this interpreter runs it.
SERVE = [sys.executable, "-m", "service", "serve"]


@dataclass
class Served:
    """A running ``hsx serve``: its process, URL, working directory and combined log."""

    proc: subprocess.Popen[bytes]
    url: str
    cwd: Path
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def output(self) -> str:
        """Everything it wrote to stdout and stderr so far."""
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def hsx_serve(
    cwd: Path,
    env: Mapping[str, str] | None = None,
    *,
    port: int | None = None,
    log: Path | None = None,
    ready_timeout_s: float = 600,
) -> Iterator[Served]:
    """``python -m service serve --port PORT`` in ``cwd`` with :func:`hsx_env` of
    ``env``, until ``/ready``; killed and reaped on the way out if still running (a
    test that stops it itself, by a signal, waits for it). stdout and stderr go to
    ``log`` (``cwd/serve.log`` by default)."""
    port = port or free_port()
    log = log or cwd / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*SERVE, "--port", str(port)],
            cwd=cwd,
            env=hsx_env(env or {}),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    served = Served(proc, f"http://127.0.0.1:{port}", cwd, log)
    try:
        wait_ready(served.url, proc, log, ready_timeout_s)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def link_demo_model(cwd: Path, demo_model: Path) -> None:
    """The demo model where ``hsx serve`` run in ``cwd`` looks for it: the machine's
    converted copy, linked (converting it again for every server would cost 30 s)."""
    (cwd / DEMO_DIR).parent.mkdir(parents=True, exist_ok=True)
    (cwd / DEMO_DIR).symlink_to(demo_model, target_is_directory=True)


def describe_process(path: str) -> None:
    """Write this process's parent pid and how many TCP sockets it holds, as JSON, to
    ``path`` (a process target: its module imports nothing heavy, so a process started
    from a fork server that lacks vLLM does not import it to unpickle this)."""
    import json

    import psutil

    me = psutil.Process()
    tcp = len(me.net_connections(kind="tcp"))
    Path(path).write_text(json.dumps({"ppid": me.ppid(), "tcp": tcp}))


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""
