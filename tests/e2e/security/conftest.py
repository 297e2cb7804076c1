"""One ``hsx serve`` for every security module (starting one takes most of a minute).

The attack modules (``test_security``, ``test_security_render``) share it; the shutdown
module, last in file order, stops it with SIGTERM. If a module asks for it after it was
stopped (another order, ``-k``), a fresh one is started with the same settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.security.harness import KEYS, Server, server_env
from tests.support.processes import hsx_serve


class SecurityServers:
    """Starts the security server on demand, and again if the last one stopped."""

    def __init__(self, model: Path, tmp: pytest.TempPathFactory) -> None:
        self.model, self.tmp = model, tmp
        self.stack = contextlib.ExitStack()
        self.current: Server | None = None

    def get(self) -> Server:
        if self.current is None or self.current.proc.poll() is not None:
            base = self.tmp.mktemp("security")
            keys = base / "keys.txt"
            keys.write_text("".join(f"{ns}:{key}\n" for ns, key in KEYS.items()))
            served = self.stack.enter_context(
                hsx_serve(base, server_env(self.model, base, keys), ready_timeout_s=240)
            )
            self.current = Server(served.proc, served.url, base / "objects", served.log)
        return self.current

    def close(self) -> None:
        self.stack.close()


@pytest.fixture(scope="session")
def security_servers(
    model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecurityServers]:
    servers = SecurityServers(model_dir("llama"), tmp_path_factory)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def server(security_servers: SecurityServers) -> Server:
    """The running security server (the tiny model, max_model_len 2048, the keys of
    ``harness.KEYS``, an 8 s deadline, the default limits)."""
    return security_servers.get()
