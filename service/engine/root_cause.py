"""The root cause of an engine that failed to start, read from what vLLM's processes logged.

vLLM's engine runs in child processes: the EngineCore, and under it one worker per
rank. When a worker raises while it starts (building the model, loading weights), the
parent hears only the EngineCore's wrapper ("WorkerProc initialization failed due to an
exception in a background process. See stack trace for root cause."); the worker's own
exception is in the traceback it logged, each line behind vLLM's prefix::

    (Worker_TP0 pid=7) ERROR 12-01 21:53:24 [multiproc_executor.py:953] Traceback ...
    (Worker_TP0 pid=7) ERROR 12-01 21:53:24 [multiproc_executor.py:953] RuntimeError: ...

:func:`root_cause` finds the last exception line of a worker's traceback (chained
exceptions end with the outermost, the one the worker died of), else the first exception
line any process logged that is not one of vLLM's wrappers. Importable without vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

#: The prefix on each line vLLM's processes log, continuation lines of a traceback
#: included (vLLM's own format, which hsx's debug log keeps: service/logs.py).
_PREFIX = re.compile(
    r"^\((?P<process>[\w.-]+) pid=\d+\) (?:[A-Z]+ [\d-]+ [\d:.]+ \[[^\]]*\] ?)?(?P<text>.*)$"
)
#: A traceback's exception line: its class (maybe dotted) and, usually, a message.
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(?P<name>\w*(?:Error|Exception))(?:: (?P<message>.*))?$")
#: What vLLM's parents raise in place of the child's error: never the root cause.
WRAPPERS = ("See root cause", "See stack trace for root cause", "initialization failed")


def _lines(log_text: str) -> Iterator[tuple[str, str]]:
    """Each line as (process, text): vLLM's prefix taken off ("" for unprefixed lines)."""
    for line in log_text.splitlines():
        found = _PREFIX.match(line)
        yield (found["process"], found["text"]) if found else ("", line)


def _tracebacks(lines: Iterable[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Each process's tracebacks as (process, lines from "Traceback" to the exception),
    in the order they began.

    A chained traceback ("The above exception was the direct cause...") is one block: it
    ends at the first line that belongs to no traceback.
    """
    blocks: list[tuple[str, list[str]]] = []
    open_blocks: dict[str, list[str]] = {}
    for process, text in lines:
        block = open_blocks.get(process)
        if block is None:
            if text.startswith("Traceback (most recent call last)"):
                open_blocks[process] = [text]
                blocks.append((process, open_blocks[process]))
        elif (
            text.startswith((" ", "\t", "Traceback", "The above exception", "During handling"))
            or not text.strip()
            or _EXCEPTION.match(text)
        ):
            block.append(text)
        else:  # the block is over: whatever the process logs next
            del open_blocks[process]
    return blocks


def _last_exception(block: list[str]) -> str | None:
    """The last exception line of one traceback block, as ``Name: message`` (a bare
    ``assert`` names the statement that failed, its last source line)."""
    for index in range(len(block) - 1, -1, -1):
        found = _EXCEPTION.match(block[index])
        if found is None:
            continue
        if found["message"]:
            return f"{found['name']}: {found['message'].strip()}"
        source = [line.strip() for line in block[:index] if line.startswith("    ")]
        code = [line for line in source if line.strip("^~ ")]
        return f"{found['name']} at `{code[-1]}`" if code else found["name"]
    return None


def worker_failure(log_text: str) -> str | None:
    """The exception a vLLM worker died of while starting, from its logged traceback."""
    for process, block in _tracebacks(_lines(log_text)):
        if not process.startswith("Worker"):
            continue
        last = _last_exception(block)
        # The first worker to fail is the cause: the others fail after it, or with it.
        if last is not None and not any(wrapper in last for wrapper in WRAPPERS):
            return last
    return None


def logged_exception(log_text: str) -> str | None:
    """The first exception line any process logged that is not a vLLM wrapper."""
    for _process, text in _lines(log_text):
        found = _EXCEPTION.match(text)
        if found and found["message"] and not any(w in text for w in WRAPPERS):
            return f"{found['name']}: {found['message'].strip()}"
    return None


def root_cause(exc: BaseException, log_text: str) -> str:
    """The most specific account of why the engine did not start, on one line: a
    worker's exception, else a child's, else the first of ``exc``'s chain."""
    text = str(exc)
    if any(wrapper in text for wrapper in WRAPPERS):
        found = worker_failure(log_text) or logged_exception(log_text)
        if found:
            return " ".join(found.split())
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else type(cause).__name__}"
