"""Single-flight: concurrent calls for one key share one run of the work."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Flight(Generic[T]):
    task: asyncio.Future[T]
    waiters: int = 0


class SingleFlight(Generic[T]):
    """Concurrent calls for one key share one run; it is cancelled when all leave.

    Only a run nobody has given up on can be joined: the last caller to leave takes the
    flight out of the table before cancelling it, so a caller arriving while the
    cancellation unwinds (the engine request being aborted) starts a fresh run instead
    of inheriting the ``CancelledError`` of a run it never gave up on.
    """

    def __init__(self) -> None:
        self._flights: dict[str, _Flight[T]] = {}

    async def run(self, key: str, start: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """The result of the run for ``key`` and whether another caller started it."""
        flight = self._flights.get(key)
        shared = flight is not None
        if flight is None:
            flight = _Flight(asyncio.ensure_future(start()))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda _: self._forget(key, flight))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task), shared
        finally:
            flight.waiters -= 1
            if not flight.waiters and not flight.task.done():
                self._forget(key, flight)  # no one may join a run being cancelled
                flight.task.cancel()  # nobody waits: abort the engine request
                await asyncio.gather(flight.task, return_exceptions=True)

    def _forget(self, key: str, flight: _Flight[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
