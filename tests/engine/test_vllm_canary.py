"""The vLLM canary (``service.engine.vllm_patches.canary``) reads a release's source
against every fingerprint: the installed vLLM here, and vLLM 0.33.0's CUDA wheel, which
this machine cannot run, fetched once from PyPI into ``var/`` and never imported."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.vllm_patches import canary
from service.engine.vllm_patches.catalog import TOUCH_POINTS
from service.engine.vllm_patches.registry import installed_tree
from service.engine.vllm_patches.sources import HSX_ROOT


def python_3_12() -> str | None:
    """A Python 3.12 that runs here (a pyenv shim may name one it will not run)."""
    candidates = [shutil.which("python3.12")]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "pass"], capture_output=True, check=False)
        if done.returncode == 0:
            return candidate
    return None


def wheel_or_skip(version: str) -> Path:
    """vLLM ``version``'s wheel from the cache under var/, fetched first if need be."""
    try:
        return canary.fetch_wheel(version)
    except canary.CanaryError as exc:  # no cache and no registry: nothing to read
        pytest.skip(str(exc))


@pytest.mark.slow
def test_the_installed_vllm_is_as_declared(capsys: pytest.CaptureFixture[str]) -> None:
    assert canary.main(["--installed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("vllm-canary: vLLM 0.32.0 (installed vllm")
    assert out[-1].endswith(", 0 changed as declared for 0.32.0, 0 not declared")


@pytest.mark.system
@pytest.mark.slow
def test_vllm_0_33_differs_only_where_declared(capsys: pytest.CaptureFixture[str]) -> None:
    wheel_or_skip("0.33.0")
    assert canary.main(["--vllm", "0.33.0"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("0 not declared")
    # What the issue found, seen by the canary itself.
    assert "+ `restore_kv_caches, supports_sleep_mode, unregister_kv_caches`" in out
    assert "get_mp_context" in out
    assert "vllm.v1.core.kv_cache_planning" in out
    assert "DIFFERS" not in out


@pytest.mark.slow  # reads the 0.33 source against every fingerprint
def test_an_undeclared_difference_fails_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A release whose source differs from every declared value: here the installed
    0.32 read as if it were 0.33.0, which declares other values."""
    tree = installed_tree("vllm")
    assert tree is not None
    text, status = canary.report(canary.observe(tree, "0.33.0"), "0.33.0", "installed")
    assert status == 1
    failing = [line for line in text.splitlines() if line.lstrip().startswith("DIFFERS")]
    assert any("preloaded-engine-processes" in line for line in failing)
    assert text.splitlines()[-1].endswith(f"{len(failing)} not declared")


def test_a_release_that_cannot_be_fetched_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    assert canary.main(["--vllm", "0.0.1", "--cache", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("vllm-canary: pip download vllm==0.0.1 failed")


@pytest.mark.system
@pytest.mark.slow
def test_fingerprints_read_the_same_under_python_3_12() -> None:
    """hsx supports Python 3.11 and 3.12; a digest must not depend on which reads it."""
    python = python_3_12()
    if python is None:
        pytest.skip("no Python 3.12 runs here")
    script = (
        "from pathlib import Path; from service.engine.vllm_patches.catalog import "
        "TOUCH_POINTS; from service.engine.vllm_patches.sources import SourceTree; "
        f"tree = SourceTree(Path({str(installed_tree('vllm').root)!r}), 'vllm'); "  # type: ignore[union-attr]
        "print('\\n'.join(f.observe(tree) for p in TOUCH_POINTS for f in p.fingerprints "
        "if f.package == 'vllm'))"
    )
    done = subprocess.run(
        [python, "-c", script],
        cwd=HSX_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tree = installed_tree("vllm")
    assert tree is not None
    here = [f.observe(tree) for p in TOUCH_POINTS for f in p.fingerprints if f.package == "vllm"]
    assert done.stdout.splitlines() == here
    assert sys.version_info[:2] == (3, 11)  # the other side of the comparison
