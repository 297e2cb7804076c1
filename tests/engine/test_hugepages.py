"""Huge pages for the engine's large CPU tensors (``service/engine/hugepages.py``): the
switch, and what the kernel does with it, in fresh interpreters as the engine's
processes start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.hugepages import VARIABLE, ask_for_huge_pages, system_mode
from tests.support.processes import hsx_env

REPO = Path(__file__).resolve().parents[2]
#: Allocates a 16 MiB tensor, touches it, and reports how much of its mapping the kernel
#: backs with huge pages (smaps).
PROBE = """
import json, torch
t = torch.empty(16 << 20, dtype=torch.uint8)
t.fill_(1)
start, huge, inside = t.data_ptr(), 0, False
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1])
print(json.dumps({"huge_kib": huge}))
"""


def probe(environ: dict[str, str], code: str = PROBE) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_switch_is_set_unless_the_operator_set_it() -> None:
    environ: dict[str, str] = {}
    assert ask_for_huge_pages(True, environ)
    assert environ == {VARIABLE: "1"}
    assert not ask_for_huge_pages(False, {}), "off writes 0, so a child keeps torch's default"
    operator = {VARIABLE: "0"}
    assert not ask_for_huge_pages(True, operator)
    assert operator == {VARIABLE: "0"}
    operator = {VARIABLE: "1"}
    assert ask_for_huge_pages(False, operator)
    assert operator == {VARIABLE: "1"}


def test_system_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    sysfs = tmp_path / "enabled"
    for text, mode in [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("", None),
    ]:
        sysfs.write_text(text)
        assert system_mode(str(sysfs)) == mode
    assert system_mode(str(tmp_path / "absent")) is None


@pytest.mark.system
@pytest.mark.slow
def test_torch_backs_large_tensors_with_huge_pages_only_when_asked() -> None:
    # hsx_env: this environment without hsx's settings or a switch an engine here set.
    on, off = hsx_env({}), hsx_env({})
    ask_for_huge_pages(True, on)
    ask_for_huge_pages(False, off)
    asked, default = probe(on), probe(off)
    mode = system_mode()
    if mode in ("madvise", "always"):
        assert int(str(asked["huge_kib"])) >= 2048, asked
    if mode == "madvise":  # only advised memory gets them: without the switch, none
        assert default["huge_kib"] == 0, default
    if mode in (None, "never"):
        pytest.skip(f"the kernel gives no transparent huge pages here ({mode})")


@pytest.mark.system
@pytest.mark.slow
def test_hsx_serve_asks_before_torch_loads() -> None:
    """``hsx serve`` sets the switch before anything imports torch, so the serving
    process (whose fork the engine's processes are) reads it: ``service.serve`` is
    replaced by the probe, which is where the real one would import vLLM."""
    code = f"""
import sys, types
assert "torch" not in sys.modules
stand_in = types.ModuleType("service.serve")
def serve(settings):
    exec({PROBE!r}, {{}})
    return 0
stand_in.serve = serve
sys.modules["service.serve"] = stand_in
from service.cli import main
sys.exit(main(["serve"]))
"""
    environ = hsx_env({})
    result = probe(environ, code)
    if system_mode() in ("madvise", "always"):
        assert int(str(result["huge_kib"])) >= 2048, result
    off = probe({**environ, "HSX_ENGINE__CPU_HUGE_PAGES": "false"}, code)
    if system_mode() == "madvise":
        assert off["huge_kib"] == 0, off
