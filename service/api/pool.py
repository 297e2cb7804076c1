"""Off the event loop: work on the bounded tokenizer pool, under the request's deadline.

Parsing a large body, rendering chat prompts and tokenising cost what a client makes
them cost, so they run on the tokenizer pool (``ApiState.tokenizer_pool``), never on the
server's event loop. ``in_pool`` answers 504 once the request's deadline
(``request_deadline``) passes and stops the work; ``LoopRun`` runs vLLM's async
renderer on a private loop in a pool thread; ``release_memory_soon`` gives the heap a
large request freed back to the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from service.api.errors import ApiError
from service.glibc import malloc_trim

if TYPE_CHECKING:
    from service.api.state import ApiState

_DEADLINE = "hsx.deadline"
T = TypeVar("T")


class TokenizingStopped(Exception):
    """Tokenising was stopped (the request's deadline passed, or it was cancelled)."""


#: Errors that answer a client (hsx's, FastAPI's, vLLM's renderer's; any other with a
#: 4xx ``status``): no stack to log.
_CLIENT_ERRORS = (
    ApiError,
    RequestValidationError,
    HTTPException,
    TokenizingStopped,
    ValueError,
    TypeError,
    OverflowError,
    NotImplementedError,
)


def timeout_error(deadline_s: float) -> ApiError:
    return ApiError(504, "timeout", f"request took longer than {deadline_s:g} s; work aborted")


def request_deadline(request: Request, timeout_s: float) -> float:
    """The request's deadline (``time.monotonic``): set once its body has arrived."""
    deadline: float | None = request.scope.get(_DEADLINE)
    if deadline is None:
        deadline = request.scope[_DEADLINE] = time.monotonic() + timeout_s
    return deadline


async def client_disconnected(request: Request) -> None:
    """Return once the client has disconnected.

    The disconnect is seen as ASGI's ``http.disconnect`` message, as vLLM's own server
    does it: ``request.is_disconnected()`` misses it behind middleware.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def in_pool(
    state: ApiState, call: Callable[[], T], deadline: float, stop: Callable[[], None] | None = None
) -> T:
    """``call()`` on the bounded tokenizer pool; a 504 once ``deadline`` passes (``stop``
    is then called, and a call still queued never starts)."""
    pool = state.tokenizer_pool
    future: Future[tuple[bool, Any]] | None = pool.submit(_outcome, call)
    assert future is not None
    try:
        remaining = max(0.0, deadline - time.monotonic())
        done, value = await asyncio.wait_for(asyncio.wrap_future(future), remaining)
    except TimeoutError:
        raise timeout_error(state.settings.limits.request_timeout_s) from None
    finally:
        future.cancel()
        if stop is not None and not future.done():
            stop()
        future = None
    if done:
        return cast(T, value)
    try:
        raise value
    finally:
        value = None  # its traceback holds this frame


def _outcome(call: Callable[[], T]) -> tuple[bool, T | BaseException]:
    """``call()``'s result, or its error as a value (raised by the caller), detached
    from the pool thread's frames.

    Those frames link back (``f_back``) to the pool's work item, which holds the error:
    a reference cycle that kept each refused body (its parsed JSON: 70 MB for 8 MB of
    empty messages) alive until a full garbage collection. So the error leaves without
    its traceback; an unexpected one keeps the stack as a note, for the server log.
    """
    try:
        return True, call()
    except Exception as exc:
        if not isinstance(exc, _CLIENT_ERRORS) and getattr(exc, "status", 500) >= 500:
            exc.add_note(
                "in the tokenizer pool:\n" + "".join(traceback.format_tb(exc.__traceback__))
            )
        pending: list[BaseException | None] = [exc]
        while pending:
            current = pending.pop()
            if current is not None and current.__traceback__ is not None:
                current.__traceback__ = None
                pending += [current.__cause__, current.__context__]
        return False, exc


class LoopRun(Generic[T]):
    """A coroutine (vLLM's async renderer) run to its end on a private event loop in a
    pool thread: its parsing, templating and tokenising never touch the server's loop,
    and ``cancel`` (from any thread) stops it at its next ``await``."""

    def __init__(self, make: Callable[[], Awaitable[T]]) -> None:
        self._make, self._lock = make, threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[T] | None = None
        self._cancelled = False

    def __call__(self) -> T:
        loop = asyncio.new_event_loop()
        try:
            with self._lock:
                if self._cancelled:
                    raise TokenizingStopped
                self._task = loop.create_task(_awaited(self._make()))
                self._loop = loop
            return loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            raise TokenizingStopped from None
        finally:
            with self._lock:  # the task holds its error, whose traceback holds us
                self._loop, self._task = None, None
            loop.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._loop is not None and self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def release_memory_soon(state: ApiState) -> None:
    """Hand the heap a large request freed back to the system, shortly after its answer
    (glibc keeps freed chunks of every thread's arena resident otherwise: the server's
    RSS once stayed a gigabyte up after a large render)."""
    trim = malloc_trim()
    pool = state.tokenizer_pool
    if trim is None:
        return

    def submit() -> None:
        with contextlib.suppress(RuntimeError):  # the pool shut down
            pool.submit(trim, 0)

    asyncio.get_running_loop().call_later(0.2, submit)
