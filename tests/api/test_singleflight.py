"""Single-flight: concurrent callers of one key share one run; leaving callers cancel it
only when none is left."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.api.singleflight import SingleFlight


async def test_concurrent_callers_share_one_run() -> None:
    flights: SingleFlight[int] = SingleFlight()
    runs, gate = 0, asyncio.Event()

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 42

    callers = [asyncio.ensure_future(flights.run("k", work)) for _ in range(16)]
    await asyncio.sleep(0)  # every caller joins before the work ends
    gate.set()
    results = await asyncio.gather(*callers)
    assert runs == 1
    assert sorted(shared for _, shared in results) == [False] + [True] * 15
    assert {value for value, _ in results} == {42}
    # Done flights are forgotten: the next call runs again.
    assert await flights.run("k", work) == (42, False)
    assert runs == 2


async def test_the_run_outlives_a_leaving_caller_but_not_the_last() -> None:
    flights: SingleFlight[int] = SingleFlight()
    started, gate = asyncio.Event(), asyncio.Event()
    cancelled = asyncio.Event()

    async def work() -> int:
        started.set()
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 7

    first = asyncio.ensure_future(flights.run("k", work))
    second = asyncio.ensure_future(flights.run("k", work))
    await started.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not cancelled.is_set()
    gate.set()
    assert await second == (7, True)

    gate.clear()
    started.clear()
    last = asyncio.ensure_future(flights.run("k", work))
    await started.wait()
    last.cancel()
    with pytest.raises(asyncio.CancelledError):
        await last
    assert cancelled.is_set()  # nobody waits any more: the work was cancelled


async def test_a_caller_arriving_while_the_run_is_cancelled_gets_a_fresh_run() -> None:
    # Issue 26, finding 5: the last caller leaves, the run is being cancelled (the
    # engine request is aborted, which takes a while), and a new caller for the same
    # key arrives in that window. It never gave up: it must get a result from a run of
    # its own, not the CancelledError of the run being torn down.
    flights: SingleFlight[int] = SingleFlight()
    started, unwinding, unwound = asyncio.Event(), asyncio.Event(), asyncio.Event()
    runs = 0

    async def work() -> int:
        nonlocal runs
        runs += 1
        if runs > 1:
            return 11
        started.set()
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends the first run
        except asyncio.CancelledError:
            unwinding.set()
            await unwound.wait()  # the abort takes a while
            raise
        return 0  # pragma: no cover

    first = asyncio.ensure_future(flights.run("k", work))
    await started.wait()
    first.cancel()
    await unwinding.wait()  # the first run is being cancelled, not yet done
    late = asyncio.ensure_future(flights.run("k", work))
    await asyncio.sleep(0)
    unwound.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await late == (11, False)  # a run of its own, not a shared cancelled one
    assert runs == 2


async def test_errors_reach_every_caller() -> None:
    flights: SingleFlight[int] = SingleFlight()

    async def work() -> int:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    results = await asyncio.gather(
        *(flights.run("k", work) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_a_replica_that_loses_the_create_only_race_returns_the_winners_object(
    app_client: Any, fake: Any
) -> None:
    # Replicas share the store, not their single-flight: both miss the lookup, both run
    # the engine, and the write decides. The loser's put finds the key taken (the real
    # writer reports that as a storage error); it must answer with the stored object.
    from tests.api.conftest import AUTH_A

    body = {"prompts": [{"token_ids": [5, 6, 7, 8, 9], "custom_id": "race"}]}
    first = (await app_client.post("/extract", json=body, headers=AUTH_A)).json()["objects"][0]
    path = fake.storage.root / first["key"]
    winner = path.read_bytes()
    path.unlink()  # as if never written: the next request misses its lookup
    fake.held.add(5)
    request = asyncio.ensure_future(app_client.post("/extract", json=body, headers=AUTH_A))
    while not fake.waiting:  # past its lookup, in the "engine"
        await asyncio.sleep(0.01)
    path.write_bytes(winner)  # the other replica's object lands first
    submitted = fake.submitted
    fake.gate.set()
    response = await request
    assert response.status_code == 200, response.text
    obj = response.json()["objects"][0]
    assert obj["status"] == "found"
    assert (obj["key"], obj["sha256"], obj["bytes"]) == (
        first["key"],
        first["sha256"],
        first["bytes"],
    )
    assert fake.submitted == submitted  # it ran once, and lost the write
    assert path.read_bytes() == winner
