"""A real Mooncake master on 127.0.0.1 for tests: ``mooncake_master`` from this venv.

``running_master()`` starts one at free ports, waits until its metrics port answers
HTTP ``/metrics``, and kills it on the way out; tests can also ``kill()`` it (SIGKILL,
as a crash) and ``restart()`` it on the same ports (an empty store: Mooncake keeps
nothing across a master restart). ``mooncake_missing()`` says why Mooncake cannot run
here (no client package, no Debian RDMA libraries, no master binary); ``running_master``
skips its caller there, so a test that needs a master skips with that reason::

    master = master_fixture("module")  # or, in a fixture of any scope:
    with running_master(tmp_path_factory.mktemp("mooncake")) as master: ...

``master.url`` is hsx's storage URL (``mooncake://127.0.0.1:PORT``), ``master.address``
what Mooncake's clients take, ``master.hsx_env()`` the ``HSX_`` variables of a server
writing to it, ``master.metrics()`` the master's own counters.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import free_port, wait_until

#: The master's command, next to this interpreter (``.venv/bin/mooncake_master``).
MASTER = Path(sys.executable).parent / "mooncake_master"


@functools.cache
def mooncake_missing() -> str | None:
    """Why a Mooncake store cannot run here, or None where it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except (ImportError, OSError) as exc:  # the wheel, or libibverbs1/librdmacm1
        return (
            "Mooncake's client is not importable (pip install "
            "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1 librdmacm1): "
            f"{exc}"
        )
    if not MASTER.is_file():
        return f"no mooncake_master next to {sys.executable}"
    return None


def skip_without_mooncake() -> None:
    """Skip the calling test (or fixture) where Mooncake cannot run."""
    reason = mooncake_missing()
    if reason:
        pytest.skip(reason)


class MooncakeMaster:
    """One ``mooncake_master`` process on 127.0.0.1; :meth:`start` it first."""

    def __init__(self, log_dir: Path, *, ready_timeout_s: float = 30.0) -> None:
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        while self.metrics_port == self.rpc_port:
            self.metrics_port = free_port()
        #: Where the master logs, across restarts.
        self.log = log_dir / f"mooncake_master-{self.rpc_port}.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, as ``MooncakeDistributedStore.setup`` takes it."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def url(self) -> str:
        """hsx's storage URL of this master's store."""
        return f"mooncake://{self.address}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def hsx_env(self, **mooncake: object) -> dict[str, str]:
        """``HSX_`` variables that point ``hsx serve`` at this store; ``mooncake``
        sets ``storage.mooncake`` options (``segment_bytes=64 * MIB``)."""
        env = {
            "HSX_STORAGE__URL": self.url,
            "HSX_STORAGE__MOONCAKE__LOCAL_HOSTNAME": "127.0.0.1",
            "HSX_STORAGE__MOONCAKE__METRICS_URL": self.metrics_url,
        }
        env.update({f"HSX_STORAGE__MOONCAKE__{k.upper()}": str(v) for k, v in mooncake.items()})
        return env

    def start(self) -> None:
        """Start the master (appending to :attr:`log`) and wait until it answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the master is already running")
        command = [
            str(MASTER),
            "--rpc_port", str(self.rpc_port),
            "--rpc_address", "127.0.0.1",
            "--metrics_port", str(self.metrics_port),
            "--metrics_host", "127.0.0.1",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        proc = self.proc

        def answers() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"mooncake_master exited ({proc.returncode}) during start-up:\n"
                    f"{self.output()[-3000:]}"
                )
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                if response.status != 200:
                    return False
            # The metrics server may answer before the RPC port listens.
            socket.create_connection(("127.0.0.1", self.rpc_port), timeout=2).close()
            return True

        wait_until(answers, self.ready_timeout_s, "mooncake_master never answered /metrics",
                   interval_s=0.02, ignore=(OSError,))  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled metrics (``master_key_count`` ...), by name."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            text = response.read().decode("utf-8", "replace")
        found: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name and not name.startswith("#") and "{" not in name:
                with contextlib.suppress(ValueError):
                    found[name] = float(value)
        return found

    def kill(self) -> None:
        """SIGKILL the master, as a crash would, and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(30)

    def restart(self) -> None:
        """Kill it if it runs, then start it again on the same ports (an empty store)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop it for good (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def output(self) -> str:
        """What the master logged so far (it logs to stderr)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def running_master(log_dir: Path, *, ready_timeout_s: float = 30.0) -> Iterator[MooncakeMaster]:
    """A started master logging to ``log_dir/mooncake_master-RPCPORT.log``, stopped on
    the way out. Skips the caller where Mooncake cannot run (call it from a fixture of
    any scope: ``tmp_path_factory.mktemp("mooncake")`` makes ``log_dir``)."""
    skip_without_mooncake()
    log_dir.mkdir(parents=True, exist_ok=True)
    master = MooncakeMaster(log_dir, ready_timeout_s=ready_timeout_s)
    try:
        master.start()
        yield master
    finally:
        master.stop()


def master_fixture(scope: Any = "module") -> Any:
    """A pytest fixture of ``scope`` that yields a :class:`MooncakeMaster`::

    mooncake_master = master_fixture("session")
    """

    @pytest.fixture(scope=scope)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
        with running_master(tmp_path_factory.mktemp("mooncake")) as master:
            yield master

    return fixture
