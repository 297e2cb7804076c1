"""``service.demo_model.prepare`` converts once when several callers start together."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from service import demo_model


def test_callers_that_start_together_convert_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four callers at once (test workers, replicas): one conversion, the others wait
    for it and return the same complete directory. The conversion itself (a pip
    download and a transformers conversion, tested by every demo-model test) is
    replaced by a slow stand-in that counts its calls."""
    calls: list[float] = []

    def convert(directory: Path, python: str) -> Path:
        calls.append(time.monotonic())
        time.sleep(0.5)  # long enough for every other caller to arrive meanwhile
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        (directory / demo_model.MARKER).write_text(json.dumps({"dtype": "float32"}))
        return directory

    monkeypatch.setattr(demo_model, "_prepare", convert)
    target = tmp_path / "models" / "demo"
    found: list[Path] = []
    threads = [
        threading.Thread(target=lambda: found.append(demo_model.prepare(target))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(calls) == 1
    assert found == [target] * 4
    assert demo_model.is_prepared(target)
