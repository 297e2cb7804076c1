"""Completions of abandoned keys become orphans, and ``close`` delivers the ones already
sent before it returns, so no object outlives the engine unreported. No engine needed:
the real ZeroMQ channel between a sender and the receiver."""

from __future__ import annotations

import asyncio
from pathlib import Path

from service.engine.completion import CompletionReceiver, CompletionSender
from service.engine.wire import Completion, StoredObject


def landed(key: str) -> Completion:
    """The completion of an object that was written."""
    stored = StoredObject(
        key=key, uri=f"file:///{key}", size=1, sha256="0", num_tokens=1, shape=(1,)
    )
    return Completion(key=key, stored=stored)


async def test_close_delivers_sent_completions_of_abandoned_keys(tmp_path: Path) -> None:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    removed: list[str] = []

    async def remove(completion: Completion) -> None:
        await asyncio.sleep(0)  # a real removal awaits storage
        removed.append(completion.key)

    receiver.on_orphan = remove
    waiter = receiver.expect("kept")
    for key in ("a", "b", "c"):
        receiver.expect(key)
        receiver.abandon(key)  # the request was cancelled before its object landed
    sender = CompletionSender(receiver.address, receiver.secret)
    for key in ("a", "kept", "b", "c"):
        sender.send(landed(key))
    sender.close()  # lingers until sent, as the worker's does at engine shutdown
    # The receiving loop never ran: close alone must deliver what was sent.
    await receiver.close()
    assert sorted(removed) == ["a", "b", "c"]
    assert waiter.done()
    assert waiter.result().key == "kept"


async def test_orphan_removals_are_awaited_by_close(tmp_path: Path) -> None:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    receiver.start()
    gate, started = asyncio.Event(), asyncio.Event()
    removed: list[str] = []

    async def slow_remove(completion: Completion) -> None:
        started.set()
        await gate.wait()
        removed.append(completion.key)

    receiver.on_orphan = slow_remove
    receiver.expect("late")
    receiver.abandon("late")
    sender = CompletionSender(receiver.address, receiver.secret)
    sender.send(landed("late"))
    sender.close()
    await asyncio.wait_for(started.wait(), 10)  # the loop picked it up: removal under way
    closing = asyncio.ensure_future(receiver.close())
    done, _ = await asyncio.wait({closing}, timeout=0.2)
    assert not done  # close waits for the removal
    gate.set()
    await closing
    assert removed == ["late"]
