"""Logging of ``hsx serve``: short lines on the console, every detail in the debug log.

The console (a terminal, or a container's log) gets INFO lines without tracebacks. The
debug log file gets every record with its traceback, and everything any process of the
service writes to its standard error: vLLM's engine and worker processes are spawned
children that inherit file descriptor 2, and Python prints their uncaught exceptions
there, so that descriptor is pointed at the debug log before the engine starts. vLLM's
own loggers (in every process) are configured through ``VLLM_LOGGING_CONFIG_PATH`` the
same way: console without tracebacks, debug log with them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

#: Records from these loggers are worth a console line at INFO.
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# vLLM's own console format (vllm/logger.py), so its lines look as they always do.
_VLLM_FORMAT = (
    "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
    "[%(fileinfo)s:%(lineno)d] %(message)s"
)
_VLLM_DATE_FORMAT = "%m-%d %H:%M:%S"


@dataclass(frozen=True)
class Console:
    """Where ``hsx serve`` talks to its user once standard error is the debug log."""

    stream: TextIO
    debug_log: Path

    def error(self, line: str) -> None:
        """Print one line for the user (a start-up error)."""
        print(line, file=self.stream, flush=True)


class NoTraceback:
    """Formatter mixin: the record without its traceback, pointing at the debug log."""

    debug_log: str = ""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            text: str = super().format(record)  # type: ignore[misc]
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        if saved[0] or saved[1]:
            text += f" (traceback in {self.debug_log})"
        return text


class ConsoleFormatter(NoTraceback, logging.Formatter):
    """hsx's and uvicorn's console lines."""

    def __init__(self, debug_log: str) -> None:
        super().__init__(_FORMAT)
        self.debug_log = debug_log


def vllm_console_formatter(fmt: str, datefmt: str, debug_log: str) -> logging.Formatter:
    """vLLM's console formatter without tracebacks; named in vLLM's logging config."""
    from vllm.logging_utils import NewLineFormatter

    cls = type("VllmConsoleFormatter", (NoTraceback, NewLineFormatter), {})
    formatter: Any = cls(fmt, datefmt)
    formatter.debug_log = debug_log
    return formatter  # type: ignore[no-any-return]


def _not_a_traceback(record: logging.LogRecord) -> bool:
    # uvicorn logs a failed lifespan's traceback as the message text itself.
    return not record.getMessage().startswith("Traceback (most recent call last)")


def open_debug_log(path: Path) -> int:
    """A fresh debug log (the last run's is replaced); returns its descriptor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)


def setup(debug_log: Path, *, json_requests: bool) -> Console:
    """Route logs for ``hsx serve``; raises OSError when the debug log cannot be made."""
    fd = open_debug_log(debug_log)
    sys.stderr.flush()
    console = Console(os.fdopen(os.dup(2), "w", buffering=1), debug_log)
    os.dup2(fd, 2)
    os.close(fd)
    _configure_python_logging(console)
    if json_requests:
        handler = logging.StreamHandler(console.stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        requests = logging.getLogger("hsx.requests")
        requests.addHandler(handler)
        requests.propagate = False
    os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", str(_write_vllm_config(debug_log)))
    return console


def _configure_python_logging(console: Console) -> None:
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    to_file = logging.StreamHandler(sys.stderr)  # descriptor 2: the debug log
    to_file.setFormatter(logging.Formatter(_FORMAT))
    to_file.setLevel(logging.DEBUG)
    to_console = logging.StreamHandler(console.stream)
    to_console.setFormatter(ConsoleFormatter(str(console.debug_log)))
    to_console.setLevel(logging.INFO)
    to_console.addFilter(_not_a_traceback)
    root.addHandler(to_file)
    root.addHandler(to_console)
    logging.captureWarnings(True)
    # Libraries' chatter at DEBUG would swamp the debug log; keep them at INFO.
    for name in ("asyncio", "httpx", "httpcore", "botocore", "boto3", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.INFO)


def _write_vllm_config(debug_log: Path) -> Path:
    """vLLM's dictConfig: its console lines without tracebacks, everything to the file."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "console": {
                "()": "service.logs.vllm_console_formatter",
                "fmt": _VLLM_FORMAT,
                "datefmt": _VLLM_DATE_FORMAT,
                "debug_log": str(debug_log),
            },
            "file": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "fmt": _VLLM_FORMAT,
                "datefmt": _VLLM_DATE_FORMAT,
            },
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "console",
                "level": "INFO",
                "stream": "ext://sys.stdout",
            },
            "file": {
                "class": "logging.FileHandler",
                "formatter": "file",
                "level": "DEBUG",
                "filename": str(debug_log),
                "mode": "a",
            },
        },
        "loggers": {"vllm": {"handlers": ["console", "file"], "level": "INFO", "propagate": False}},
    }
    path = debug_log.with_name(debug_log.name + ".vllm-logging.json")
    path.write_text(json.dumps(config, indent=2))
    return path
