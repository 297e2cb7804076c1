"""hsx's patches of vLLM install only where they apply (``service.engine.vllm_patches``).

No engine: the real registry against the vLLM installed here. A patch is declared for
the hosts it applies to and checked against the source it replaces; where that source
is not what it was checked against, a performance patch is left off with one warning
line and a correctness patch stops ``hsx serve`` with one line naming it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import EngineSettings
from service.engine.vllm_patches import catalog, cpu_mamba, drafts, registry
from service.engine.vllm_patches.doc import render
from service.engine.vllm_patches.fingerprints import Digest
from service.engine.vllm_patches.registry import Kind, PatchTargetChanged, applies
from service.startup import StartupError, check_vllm_patches

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm-coupling.md"


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test checks the patches anew (the process keeps what it learnt)."""
    monkeypatch.setattr(registry, "_verified", {})
    registry._warn_once.cache_clear()
    yield
    registry._warn_once.cache_clear()


def changed(patch: registry.TouchPoint) -> registry.TouchPoint:
    """``patch`` as if vLLM had changed its first target since it was checked."""
    first = patch.fingerprints[0]
    other = dataclasses.replace(first, accepted={"0.32.0": "0123456789abcdef"})
    return dataclasses.replace(patch, fingerprints=(other, *patch.fingerprints[1:]))


def test_every_patch_holds_against_the_installed_vllm_and_python() -> None:
    for patch in catalog.PATCHES:
        assert registry.problem_of(patch) is None, patch.name


def test_every_patch_here_is_cpu_only_and_never_installed_on_a_gpu_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GPU hosts run vLLM as shipped: async scheduling, Model Runner V2, no fork server.
    assert all(patch.platforms == registry.CPU_ONLY for patch in catalog.PATCHES)
    monkeypatch.setattr(registry, "host_platform", lambda: "cuda")
    assert not any(applies(patch) for patch in catalog.PATCHES)
    assert registry.snapshot() == {}  # not even fingerprinted there


@pytest.mark.slow  # imports vLLM's EngineCore: about 10 s here
def test_a_performance_patch_whose_target_changed_is_left_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(drafts, "PATCH", changed(drafts.PATCH))
    monkeypatch.setattr(EngineCore, "post_step", EngineCore.post_step)  # restored after
    original = EngineCore.post_step
    with caplog.at_level(logging.WARNING):
        drafts.skip_unused_draft_fetches()
        drafts.skip_unused_draft_fetches()
    assert EngineCore.post_step is original  # vLLM's own behaviour runs
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hsx:")]
    assert len(lines) == 1, lines
    assert "performance patch 'skip-unused-draft-fetches' left off" in lines[0]
    assert "vLLM 0.32.0" in lines[0]
    assert "EngineCore.post_step" in lines[0]


def test_a_correctness_patch_whose_target_changed_stops_start_up_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_mamba, "PATCH", changed(cpu_mamba.PATCH))
    with pytest.raises(PatchTargetChanged):
        cpu_mamba.install()
    with pytest.raises(StartupError) as caught:
        check_vllm_patches(EngineSettings())
    line = caught.value.line
    assert caught.value.exit_code == 2
    assert line.startswith("hsx: error: vLLM 0.32.0 changed what hsx's correctness patch ")
    assert "'cpu-mamba-conv-update'" in line
    assert "causal_conv1d_update_cpu" in line
    assert "vllm>=0.32,<0.34" in line
    assert "\n" not in line


def test_a_patch_is_off_where_one_it_builds_on_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.vllm_patches import mp_context, openmp

    patch = dataclasses.replace(mp_context.PATCH, requires=(changed(openmp.PATCH),))
    assert not applies(patch)
    registry._verified.clear()
    assert applies(mp_context.PATCH)  # with the requirement as checked


def test_start_up_checks_only_the_patches_the_settings_use() -> None:
    names = {p.name for p in catalog.in_use(EngineSettings(preload_engine_processes=False))}
    assert names == {
        "skip-unused-draft-fetches",
        "cpu-mamba-conv-update",
        "unpadded-first-mamba-chunks",
    }
    every = {p.name for p in catalog.in_use(EngineSettings())}
    assert every == {p.name for p in catalog.PATCHES} - {
        "cpython-fork-server",
        "openmp-settings-after-fork",
    }
    assert check_vllm_patches(EngineSettings()) is None  # this install: all hold


def test_engine_processes_take_the_checks_of_their_parent() -> None:
    registry.adopt({"skip-unused-draft-fetches": "changed"})
    assert registry.problem_of(drafts.PATCH) == "changed"  # not read again
    assert not applies(drafts.PATCH)


def test_every_touch_point_says_what_where_why_and_when_checked() -> None:
    root = Path(__file__).resolve().parents[2]
    for point in catalog.TOUCH_POINTS:
        assert all((point.why, point.target, point.hsx, point.checked_on)), point.name
        assert (root / point.hsx.split(" ")[0].rstrip(",")).exists(), point.hsx
    for patch in catalog.PATCHES:
        assert patch.kind in (Kind.CORRECTNESS, Kind.PERFORMANCE)
        assert patch.fingerprints, patch.name
    assert isinstance(drafts.PATCH.fingerprints[0], Digest)


def test_the_coupling_page_is_current() -> None:
    assert PAGE.read_text() == render(), (
        "docs/vllm-coupling.md is stale: run `python -m service.engine.vllm_patches > "
        "docs/vllm-coupling.md`"
    )


@pytest.mark.parametrize(
    ("index", "setting"),
    [
        (0, "engine.cpu_kvcache_space_gib"),  # a KV cache too small for one sequence
        (2, "engine.cpu_kvcache_space_gib"),  # no room for one block
        (3, "engine.cpu_kvcache_space_gib"),  # the cache over the node's free memory
        (4, "engine.gpu_memory_utilization"),  # 0.32's start-up utilisation check
        (5, "engine.gpu_memory_utilization"),  # 0.33's worker over its reservation
        (6, None),  # fewer NUMA nodes than ranks
    ],
)
def test_each_message_the_canary_watches_is_one_start_up_names(
    index: int, setting: str | None
) -> None:
    """The wording the canary looks for in vLLM's source is the wording start-up
    turns into a setting to change (``service.startup.from_engine``)."""
    from service.engine.vllm_patches.touchpoints import MESSAGES
    from service.startup import from_engine

    text = MESSAGES.fingerprints[index].target.replace("{}", "1")
    text += " GiB). " if text.endswith("(1") else ""
    died = RuntimeError("Engine core initialization failed. See root cause above.")
    error = from_engine(died, f"(EngineCore pid=1) ValueError: {text}", on_cpu=True)
    assert error.setting == setting, error.line
    assert "the engine failed to start" not in error.line
