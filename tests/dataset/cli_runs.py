"""``hsx dataset run`` as a user runs it, in this process (so a test's monkeypatches
apply) and on a thread the test waits for at most a bound, and what it leaves in its
output: the manifest's lines and ``summary.json``."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from service.cli import main

#: Wall-time bound of one run (a loaded 2-core machine; a healthy run takes ~1 s).
LIMIT_S = 60.0


def dataset_run(tmp_path: Path, source: Path, urls: list[str], *extra: str) -> tuple[int, float]:
    """``hsx dataset run SOURCE --output TMP/out``: (exit code, seconds); a run still
    going after LIMIT_S, or one that raised, fails the test."""
    argv = ["dataset", "run", str(source), "--output", str(tmp_path / "out"), "--no-progress"]
    for url in urls:
        argv += ["--endpoint", url]
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["code"] = main([*argv, *extra])
        except BaseException as exc:  # a traceback is a failure too: keep it for the assert
            result["raised"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    elapsed = time.monotonic() - started
    assert not thread.is_alive(), f"hsx dataset run still running after {LIMIT_S} s (a hang)"
    assert "raised" not in result, f"hsx dataset run raised {result['raised']!r}"
    return int(result["code"]), elapsed


def write_input(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def read_manifest(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "out" / "manifest.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_summary(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads((tmp_path / "out" / "summary.json").read_text()))
