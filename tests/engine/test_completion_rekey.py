"""The completion channel when a key comes back: an idempotent prompt retried after its
first request was abandoned (its client was killed) must get its completion."""

from __future__ import annotations

import asyncio
from pathlib import Path

from service.engine.completion import Completion, CompletionReceiver, CompletionSender


def stored(key: str, num_tokens: int = 3) -> Completion:
    """A completion saying ``key``'s object is durable (either shape of Completion)."""
    if "stored" in getattr(Completion, "model_fields", {}):  # the typed wire messages
        from service.engine.wire import StoredObject  # type: ignore[import-not-found]

        obj = StoredObject(key=key, uri="file:///x", size=10, sha256="s",
                           num_tokens=num_tokens, shape=(num_tokens, 1, 1))  # fmt: skip
        return Completion(key=key, stored=obj)  # type: ignore[call-arg]
    return Completion(key=key, ok=True, size=10, sha256="s", num_tokens=num_tokens)


async def test_a_key_expected_again_after_abandon_gets_its_completion(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path / 'completions.sock'}"
    receiver = CompletionReceiver(address)
    orphans: list[Completion] = []

    async def on_orphan(completion: Completion) -> None:
        orphans.append(completion)

    receiver.on_orphan = on_orphan
    receiver.start()
    sender = CompletionSender(address, receiver.secret)
    try:
        key = "hsx/ns/by-id/ab/" + "0" * 64 + ".safetensors"
        receiver.expect(key)
        receiver.abandon(key)  # the first client went away before its object was written
        retry = receiver.expect(key)  # the same prompt again, same key
        sender.send(stored(key))
        completion = await asyncio.wait_for(retry, 30)
        assert completion == stored(key)
        assert orphans == []

        # A key abandoned and not asked again still goes to on_orphan.
        other = key.replace("ab", "cd")
        receiver.expect(other)
        receiver.abandon(other)
        sender.send(stored(other))
        async with asyncio.timeout(30):
            while not orphans:
                await asyncio.sleep(0.01)
        assert [o.key for o in orphans] == [other]
    finally:
        sender.close()
        await receiver.close()
