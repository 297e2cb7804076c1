"""The completion channel on its own (no engine): a real ZeroMQ PUSH/PULL pair over IPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq

from service.engine.completion import CompletionReceiver, CompletionSender
from service.engine.wire import Completion, StoredObject, WriteFailure
from service.storage import StorageOp

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
    sender = CompletionSender(receiver.address)
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


async def test_malformed_and_unknown_messages_are_dropped(channel: tuple) -> None:
    receiver, sender = channel
    seen: list[Completion] = []
    receiver.on_message = seen.append
    waiter = receiver.expect(KEY)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(receiver.address)
    raw.send(b"not json")
    raw.send(b'{"key": "k"}')  # neither stored nor failure
    raw.send(b'{"key": "k", "failure": {"type": "nonsense", "message": "x"}}')
    raw.close(linger=1000)
    sender.send(stored(KEY.replace("a" * 32, "c" * 32)))  # nobody waits for it
    sender.send(stored())
    assert (await asyncio.wait_for(waiter, 10)).key == KEY  # the loop survived them all
    assert [c.key for c in seen] == [KEY.replace("a" * 32, "c" * 32), KEY]


async def test_close_cancels_waiters(tmp_path: Path) -> None:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    receiver.start()
    waiter = receiver.expect(KEY)
    await receiver.close()
    assert waiter.cancelled()
