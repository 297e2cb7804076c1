"""The completion channel on its own (no engine): a real ZeroMQ PUSH/PULL pair over IPC."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
from pydantic import ValidationError

from service.engine.completion import CompletionReceiver, CompletionSender, max_message_bytes
from service.engine.wire import Completion, StoredObject, WriteFailure, WriterHello
from service.storage import StorageOp
from tests.engine.conftest import wait_until

KEY = "hsx/team/2026/01/01/" + "a" * 32 + ".safetensors"


def stored(key: str = KEY) -> Completion:
    obj = StoredObject(
        key=key, uri=f"file:///x/{key}", size=10, sha256="0" * 64, num_tokens=2, shape=(2, 3, 4)
    )
    op = StorageOp("file", "put", 0.01, written=10)
    return Completion(key=key, stored=obj, bytes_in_flight=0, storage_ops=(op,))


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[tuple[CompletionReceiver, CompletionSender]]:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    receiver.start()
    sender = CompletionSender(receiver.address, receiver.secret)
    yield receiver, sender
    sender.close()
    await receiver.close()


async def test_a_completion_reaches_its_waiter_and_the_observer(channel: tuple) -> None:
    receiver, sender = channel
    seen: list[Completion] = []
    receiver.on_message = seen.append
    waiter = receiver.expect(KEY)
    sender.send(stored())
    got = await asyncio.wait_for(waiter, 10)
    assert got == stored()  # every field survives the trip, nested ones included
    assert got.storage_ops[0].written == 10
    assert seen == [got]


async def test_a_failure_arrives_typed(channel: tuple) -> None:
    receiver, sender = channel
    waiter = receiver.expect(KEY)
    failure = WriteFailure(type="invalid_hidden_states", message="NaN", reason="non_finite")
    sender.send(Completion(key=KEY, failure=failure))
    assert (await asyncio.wait_for(waiter, 10)).failure == failure


async def test_abandoned_keys_go_to_on_orphan(channel: tuple) -> None:
    receiver, sender = channel
    orphans: asyncio.Queue[Completion] = asyncio.Queue()

    async def on_orphan(completion: Completion) -> None:
        await orphans.put(completion)

    receiver.on_orphan = on_orphan
    late, early = KEY.replace("a" * 32, "b" * 32), KEY
    # Abandoned before its completion arrives: the completion goes to on_orphan.
    waiter = receiver.expect(late)
    receiver.abandon(late)
    assert waiter.cancelled()
    sender.send(stored(late))
    assert (await asyncio.wait_for(orphans.get(), 10)).key == late
    # Abandoned after it arrived (the caller was cancelled meanwhile): same.
    waiter = receiver.expect(early)
    sender.send(stored(early))
    await asyncio.wait_for(asyncio.shield(waiter), 10)
    receiver.abandon(early, waiter)
    assert (await asyncio.wait_for(orphans.get(), 10)).key == early


def tagged(receiver: CompletionReceiver, payload: bytes) -> list[bytes]:
    """A message as the writer frames it: the payload's HMAC under the channel's secret,
    then the payload."""
    key = bytes.fromhex(receiver.secret)
    return [hmac.new(key, payload, hashlib.sha256).digest(), payload]


async def test_unauthenticated_malformed_and_unknown_messages_are_dropped_and_counted(
    channel: tuple,
) -> None:
    receiver, sender = channel
    seen: list[Completion] = []
    receiver.on_message = seen.append
    waiter = receiver.expect(KEY)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(receiver.address)
    forged = stored().encode()
    raw.send(forged)  # a well-formed completion with no tag
    raw.send_multipart([b"\0" * 32, forged])  # a wrong tag
    raw.send_multipart([*tagged(receiver, forged)[:1], forged + b" "])  # another payload
    raw.send_multipart([b"a", b"b", b"c"])  # three frames
    raw.send_multipart(tagged(receiver, b"not json"))
    raw.send_multipart(tagged(receiver, b'{"key": "k"}'))  # neither stored nor failure
    raw.send_multipart(tagged(receiver, stored().encode().replace(b'"hsx/', b'"../', 1)))
    raw.close(linger=1000)
    other = KEY.replace("a" * 32, "c" * 32)
    sender.send(stored(other))  # authentic, but nobody waits for it
    sender.send(stored())
    assert (await asyncio.wait_for(waiter, 10)).key == KEY  # the loop survived them all
    # The two sockets' messages are fair-queued: the forged ones may land after the
    # authentic ones, so wait until all eight are counted.
    expected = {"unauthenticated": 4, "malformed": 3, "unknown_key": 1}
    await wait_until(lambda: receiver.dropped == expected, 10)
    assert receiver.dropped == expected
    assert [c.key for c in seen] == [KEY]  # only a completion somebody waited for


async def test_a_forged_hello_does_not_open_the_gate(channel: tuple) -> None:
    receiver, sender = channel
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(receiver.address)
    raw.send(WriterHello(writer_pid=1, host="evil").model_dump_json().encode())
    raw.close(linger=1000)
    await wait_for_drops(receiver, 1)
    assert not receiver.writer_ready.is_set()
    sender.hello()
    await asyncio.wait_for(receiver.writer_ready.wait(), 10)


async def wait_for_drops(receiver: CompletionReceiver, count: int) -> None:
    async with asyncio.timeout(10):
        while sum(receiver.dropped.values()) < count:
            await asyncio.sleep(0.01)


async def test_a_message_over_the_size_limit_is_refused_by_zeromq(tmp_path: Path) -> None:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}", max_message_bytes=1 << 20)
    receiver.start()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(receiver.address)
    try:
        waiter = receiver.expect(KEY)
        big = StoredObject(key=KEY, uri="", size=2 << 20, sha256="0" * 64, num_tokens=9,
                           shape=(9, 1, 1), data=b"x" * (2 << 20))  # fmt: skip
        raw.send_multipart(tagged(receiver, Completion(key=KEY, stored=big).encode()))
        # ZeroMQ drops the peer that sent it and the socket connects again: what follows
        # still arrives, and the big message never reached hsx's code at all.
        raw.send_multipart(tagged(receiver, stored().encode()))
        got = await asyncio.wait_for(waiter, 10)
        assert got.stored is not None
        assert got.stored.num_tokens == 2
        assert sum(receiver.dropped.values()) == 0
    finally:
        raw.close(linger=0)
        await receiver.close()


def test_a_completion_names_one_safe_key() -> None:
    with pytest.raises(ValidationError, match=r"stored\.key differs"):
        Completion(key=KEY.replace("a" * 32, "b" * 32), stored=stored().stored)
    with pytest.raises(ValidationError, match="not allowed"):
        Completion(key="../etc/passwd", failure=WriteFailure(type="internal_error", message="x"))


def test_max_message_bytes_holds_an_inline_object_in_base64() -> None:
    limit = max_message_bytes(1 << 20)
    obj = StoredObject(key=KEY, uri="", size=1 << 20, sha256="0" * 64, num_tokens=1,
                       shape=(1, 1, 1), data=b"\xff" * (1 << 20))  # fmt: skip
    assert len(Completion(key=KEY, stored=obj).encode()) < limit < 6 << 20


async def test_close_cancels_waiters(tmp_path: Path) -> None:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    receiver.start()
    waiter = receiver.expect(KEY)
    await receiver.close()
    assert waiter.cancelled()
