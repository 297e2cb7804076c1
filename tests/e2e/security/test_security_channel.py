"""The completion channel on TCP, attacked from the network as the red team did: a
ZeroMQ PUSH socket connected to the port the API listens on, with no hsx key and no
channel secret, sending what the writer sends (``service.engine.completion``).

The security server runs its channel on ``tcp://127.0.0.1:0`` (``harness.server_env``).
Every forged message must be dropped and counted before it is parsed, the victim's
request must get its real answer, and nothing a message says may grow ``/metrics``, the
server's memory or the time ``/health`` takes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import zmq

from service.engine.wire import Completion, StoredObject, WriteFailure, WriterHello
from service.storage.base import StorageOp
from tests.e2e.security.harness import MIB, Server, auth, normal_client, rss_peak, wait_for

# Against the security package's hsx serve (an engine), as its other modules are.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

DROPPED = "hsx_completion_messages_dropped_total"
FLOOD_S = 20.0


def listening(server: Server) -> list[psutil._common.pconn]:
    """The API process's listening TCP sockets."""
    return [c for c in server.process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]


def channel_port(server: Server) -> int:
    """The completion channel's port: the API's listening socket that is not HTTP's."""
    ports = {c.laddr.port for c in listening(server)} - {server.host_port[1]}
    assert len(ports) == 1, f"expected one listening port besides HTTP's, got {ports}"
    return ports.pop()


@contextlib.contextmanager
def attacker(server: Server) -> Iterator[zmq.Socket[bytes]]:
    """A PUSH socket connected to the channel, holding no secret."""
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{channel_port(server)}")
    try:
        yield push
    finally:
        push.close(linger=2000)
        context.term()


def dropped(server: Server) -> float:
    return server.metric(DROPPED, reason="unauthenticated")


def wait_dropped(server: Server, count: float, limit_s: float = 60) -> None:
    wait_for(lambda: dropped(server) >= count, limit_s, f"{count:g} messages never counted")


def test_the_channel_listens_on_the_addresses_host_only(server: Server) -> None:
    addresses = {c.laddr.ip for c in listening(server)}
    assert addresses == {"127.0.0.1"}, addresses  # was 0.0.0.0 for tcp://127.0.0.1:0
    channel_port(server)  # and it is there


def test_forged_completions_are_dropped_and_the_victim_gets_its_real_answer(
    server: Server,
) -> None:
    body = {"prompts": [{"token_ids": [11, 12, 13, 14], "custom_id": "victim"}]}
    with httpx.Client(base_url=server.url, timeout=60, headers=auth("normal")) as client:
        # The key a custom_id maps to is computable from outside; learn it, then free it.
        first = client.post("/extract", json=body).json()["objects"][0]
        victim = first["key"]
        assert client.delete(f"/objects/{victim}").status_code == 204
        foreign = victim.replace("/normal/", "/gone/")
        forged = [
            Completion(key=victim, failure=WriteFailure(type="invalid_hidden_states",
                                                        message="forged", reason="non_finite")),
            Completion(key=foreign, stored=StoredObject(key=foreign, uri="file:///forged",
                                                        size=1, sha256="f" * 64, num_tokens=7,
                                                        shape=(7, 1, 1))),
            WriterHello(writer_pid=1, host="evil"),
        ]  # fmt: skip
        # The foreign success under the victim's key, as the red team sent it.
        raw = forged[1].model_dump_json().replace(f'"key":"{foreign}",', f'"key":"{victim}",', 1)
        messages = [m.model_dump_json().encode() for m in forged] + [raw.encode()]
        before, sent, done = dropped(server), 0, threading.Event()
        with attacker(server) as push:

            def flood() -> None:
                nonlocal sent
                while not done.is_set():
                    for message in messages:
                        push.send(message)
                        sent += 1

            thread = threading.Thread(target=flood)
            thread.start()
            try:
                answer = client.post("/extract", json=body)
            finally:
                done.set()
                thread.join(30)
    assert answer.status_code == 200, answer.text
    obj = answer.json()["objects"][0]
    assert (obj["status"], obj["key"], obj["num_tokens"]) == ("created", victim, 4)
    data = (server.root / victim).read_bytes()
    assert obj["sha256"] == hashlib.sha256(data).hexdigest()
    assert sent >= len(messages)
    wait_dropped(server, before + sent)
    assert dropped(server) == before + sent  # each one counted, none delivered
    httpx.delete(f"{server.url}/objects/{victim}", headers=auth("normal"), timeout=10)


def label_bomb(count: int) -> Iterator[bytes]:
    """Completions whose label values are all new: backends, operations, error kinds
    and layer ids, as the red team's 20,000 grew ``/metrics`` from 85 KB to 50 MB."""
    for i in range(count):
        key = f"hsx/normal/2026/01/01/{i:032x}.safetensors"
        op = StorageOp(f"b{i}", f"op{i}", 0.1, written=1, error=f"kind{i}")
        obj = StoredObject(key=key, uri="file:///x", size=1, sha256="0" * 64, num_tokens=1,
                           shape=(1, 1, 1), layer_ids=(999_000 + i,))  # fmt: skip
        yield Completion(key=key, stored=obj, storage_ops=(op,)).encode()


def test_twenty_thousand_label_values_leave_metrics_and_memory_as_they_were(
    server: Server,
) -> None:
    metrics_before = len(httpx.get(f"{server.url}/metrics", timeout=10).content)
    rss_before = server.process.memory_info().rss
    before = dropped(server)
    with attacker(server) as push:
        for message in label_bomb(20_000):
            push.send_multipart([os.urandom(32), message])
    wait_dropped(server, before + 20_000)
    metrics_after = len(httpx.get(f"{server.url}/metrics", timeout=10).content)
    rss_after = server.process.memory_info().rss
    print(f"/metrics {metrics_before} -> {metrics_after} bytes; "
          f"RSS {rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MiB")  # fmt: skip
    assert abs(metrics_after - metrics_before) <= 0.05 * metrics_before
    assert rss_after - rss_before < 64 * MIB


def test_a_frame_over_the_limit_is_refused_by_zeromq(server: Server) -> None:
    before = sum(server.metric(DROPPED, reason=r) for r in ("unauthenticated", "malformed"))
    frame = b"x" * (96 * MIB)  # the limit is the largest inline object in base64, ~5.4 MiB
    with rss_peak(server) as rss, attacker(server) as push:
        tracker = push.send(frame, copy=False, track=True)
        tracker.wait(30)  # handed to ZeroMQ's I/O thread
        push.send_multipart([os.urandom(32), b"small"])  # a new connection after the drop
        wait_dropped(server, before + 1)
    after = sum(server.metric(DROPPED, reason=r) for r in ("unauthenticated", "malformed"))
    assert after == before + 1  # the small one only: the big frame never reached hsx
    assert rss["peak"] - rss["before"] < 32 * MIB  # it was never buffered
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_health_stays_fast_during_a_flood(server: Server) -> None:
    done, sent = threading.Event(), [0]

    def flood() -> None:
        with attacker(server) as push:
            message = [os.urandom(32), b'{"key": "hsx/normal/x", "failure": {}}']
            while not done.is_set():
                for _ in range(1000):
                    push.send_multipart(message)
                sent[0] += 1000

    latencies: list[float] = []
    with normal_client(server):
        thread = threading.Thread(target=flood)
        thread.start()
        end = time.monotonic() + FLOOD_S
        try:
            while time.monotonic() < end:
                probe = time.monotonic()
                assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
                latencies.append(time.monotonic() - probe)
                time.sleep(0.05)
        finally:
            done.set()
            thread.join(30)
    median = statistics.median(latencies)
    print(f"flood: {sent[0]} messages in {FLOOD_S:g} s; /health median {median * 1000:.1f} ms, "
          f"slowest {max(latencies) * 1000:.0f} ms")  # fmt: skip
    assert median < 0.5
