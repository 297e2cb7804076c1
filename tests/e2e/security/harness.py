"""The security tests' server and helpers: one ``hsx serve`` on the tiny model with
keys, tight timeouts and an 8 s deadline, a normal client that must always succeed, and
the server's RSS and CPU as psutil sees them."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.processes import wait_until

MIB = 1024 * 1024
KEYS = {
    "normal": "normal-key-0123456789abcdef",
    "gone": "gone-key-0123456789abcdef",
    "slow": "slow-key-0123456789abcdef",
    "shut": "shut-key-0123456789abcdef",
}
HEADER_TIMEOUT_S = 3.0
DEADLINE_S = 8.0
# Server CPU an attack without a key may cost (the normal client's extracts included):
# its bytes are read off the socket and dropped, never parsed.
UNAUTHENTICATED_CPU_S = 2.0
GRACE_S = 1
#: Prefill tokens a prompt gets per engine step (vLLM's long_prefill_token_threshold).
CHUNK = 4
#: Prompt lengths of a long request: 64 prompts whose prefill ends (and whose object
#: lands) one every ~7 steps, from the 2nd step to the 450th: on any machine speed some
#: land within the first seconds and the last long after the deadline.
LONG_LENGTHS = [8 + 28 * i for i in range(64)]


def auth(namespace: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[namespace]}"}


def server_env(model: Path, base: Path, keys: Path) -> dict[str, str]:
    """The server's settings: ``model`` (the tiny one), max_model_len 2048, the key file
    ``keys``, tight connection timeouts, an 8 s deadline, the default limits, the
    completion channel on TCP; objects under ``base/objects``."""
    return {
        "HSX_ENGINE__MODEL": str(model),
        "HSX_ENGINE__DTYPE": "float32",
        "HSX_ENGINE__MAX_MODEL_LEN": "2048",
        "HSX_ENGINE__MAX_NUM_BATCHED_TOKENS": "4096",
        "HSX_ENGINE__CPU_KVCACHE_SPACE_GIB": "1",
        "HSX_ENGINE__EXTRA_ARGS": json.dumps(
            {"enforce_eager": True, "long_prefill_token_threshold": CHUNK, "max_num_seqs": 512}
        ),
        "HSX_STORAGE__URL": str(base / "objects"),
        "HSX_SERVER__API_KEYS_FILE": str(keys),
        "HSX_SERVER__HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "HSX_SERVER__BODY_TIMEOUT_S": "5",
        "HSX_SERVER__KEEP_ALIVE_TIMEOUT_S": "2",
        "HSX_SERVER__SHUTDOWN_GRACE_S": str(GRACE_S),
        "HSX_LIMITS__REQUEST_TIMEOUT_S": str(DEADLINE_S),
        # The channel on TCP, where anyone who reaches the port can send to it
        # (test_security_channel attacks it).
        "HSX_ENGINE__COMPLETION_ADDRESS": "tcp://127.0.0.1:0",
    }


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    root: Path
    log: Path

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    def objects(self, namespace: str) -> set[str]:
        base = self.root / "hsx" / namespace
        if not base.exists():
            return set()
        return {str(p.relative_to(self.root)) for p in base.rglob("*.safetensors")}

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "")
        found = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0


def wait_for(condition: Any, limit_s: float, message: str) -> float:
    """Seconds until ``condition()`` holds; fails past ``limit_s``."""
    start = time.monotonic()
    wait_until(condition, limit_s, message)
    return time.monotonic() - start


@dataclass
class NormalClient:
    """Extracts one short prompt after another, at least one of them while the attack
    runs; every reply must be a 200. A failed request is kept as its exception's text."""

    url: str
    statuses: list[int | str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"prompts": [{"token_ids": [5, 6, 7, 8, 9]}]}
        with httpx.Client(base_url=self.url, timeout=60, headers=auth("normal")) as client:
            # One request at least, even when the attack is over before this thread runs
            # (20 refusals from the headers alone can take less than a thread's start).
            while True:
                started = time.monotonic()
                self.started.set()
                try:
                    self.statuses.append(client.post("/extract", json=body).status_code)
                except httpx.HTTPError as exc:
                    self.statuses.append(f"{type(exc).__name__}: {exc}")
                self.latencies.append(time.monotonic() - started)
                if self.stop.is_set():
                    return


@contextlib.contextmanager
def normal_client(server: Server) -> Iterator[NormalClient]:
    client = NormalClient(server.url)
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    assert client.started.wait(30), "the normal client did not start"
    try:
        yield client
    finally:
        client.stop.set()
        thread.join(60)
    assert client.statuses, "the normal client never finished a request"
    assert set(client.statuses) == {200}, client.statuses
    print(
        f"normal client: {len(client.statuses)} extracts, all 200, "
        f"slowest {max(client.latencies):.2f} s"
    )


@contextlib.contextmanager
def rss_peak(server: Server) -> Iterator[dict[str, int]]:
    """Samples the server's RSS every 20 ms: ``before``, ``peak`` and ``after``."""
    process = server.process
    seen = {"before": process.memory_info().rss, "peak": 0, "after": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen["peak"] = max(seen["peak"], process.memory_info().rss)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)
        seen["after"] = process.memory_info().rss
        print(
            f"server RSS: before {seen['before'] / MIB:.0f} MiB, peak {seen['peak'] / MIB:.0f}, "
            f"after {seen['after'] / MIB:.0f}"
        )


def cpu_s(server: Server) -> float:
    times = server.process.cpu_times()
    return float(times.user + times.system)


def long_body(namespace_seed: int) -> dict[str, Any]:
    prompts = [
        {"token_ids": [3 + (namespace_seed + i * 7 + j) % 500 for j in range(n)]}
        for i, n in enumerate(LONG_LENGTHS)
    ]
    return {"prompts": prompts, "max_tokens": 1}
