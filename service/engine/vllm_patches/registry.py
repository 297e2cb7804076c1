"""What a touch point declares, and the check every patch passes before it is installed.

A :class:`TouchPoint` is one place where hsx depends on code it does not own: a patch
that replaces part of vLLM's (or CPython's, or OpenMP's) behaviour, or an internal hsx
only reads or builds on. Each declares what it touches, why, the platforms it applies
to, the vLLM versions it was checked on and the fingerprints of its target
(``fingerprints``).

A patch is installed only through :func:`applies`: on a host of one of its platforms
(a CPU-only patch is never installed on a GPU host), with every patch it builds on
applying too, and with its fingerprints holding against the installed source. Where a
target changed, a performance patch is left off (vLLM's own behaviour runs) with one
warning line naming it, and a correctness patch raises :class:`PatchTargetChanged`,
which ``hsx serve`` prints as its one start-up error line (``service.startup``).
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import multiprocessing
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from service.engine.vllm_patches.fingerprints import Fingerprint
from service.engine.vllm_patches.sources import SourceTree
from service.vllm_version import installed_vllm

log = logging.getLogger(__name__)


class Kind(enum.Enum):
    """What a touch point does to the code it touches."""

    #: Replaces behaviour that is wrong for hsx: without it results are wrong.
    CORRECTNESS = "correctness patch"
    #: Replaces behaviour that is slow for hsx: without it vLLM's own runs, slower.
    PERFORMANCE = "performance patch"
    #: Sets process-wide state (environment, allocator) that vLLM's processes run with.
    SETS = "sets"
    #: Reads vLLM's internals or builds on its interfaces; changes nothing.
    READS = "reads"


#: Checked on: run by this project's CPU suite, or read in the wheel's source only.
RUN, READ = "run on CPU", "source read"


@dataclass(frozen=True)
class TouchPoint:
    """One place where hsx depends on another project's internals."""

    #: Short stable name, used in messages and in docs/vllm-coupling.md.
    name: str
    kind: Kind
    #: hsx's code that does it (a path in this repository).
    hsx: str
    #: What it replaces or reads, in words with dotted names.
    target: str
    #: Why hsx does it.
    why: str
    #: The hosts it applies to: ``cpu``, ``cuda``.
    platforms: frozenset[str]
    #: vLLM versions it was checked on, each with how (``RUN`` or ``READ``).
    checked_on: Mapping[str, str]
    fingerprints: tuple[Fingerprint, ...] = ()
    #: Patches it builds on: it is installed only where they are.
    requires: tuple[TouchPoint, ...] = ()
    #: By vLLM version: what changed there, and why hsx still holds.
    notes: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_patch(self) -> bool:
        """Whether hsx installs something for it (a correctness or performance patch)."""
        return self.kind in (Kind.CORRECTNESS, Kind.PERFORMANCE)


CPU_ONLY = frozenset({"cpu"})
EVERY_HOST = frozenset({"cpu", "cuda"})


class PatchTargetChanged(RuntimeError):
    """A correctness patch's target is not what hsx was checked against."""

    def __init__(self, point: TouchPoint, problem: str) -> None:
        self.point, self.problem = point, problem
        super().__init__(self.line)

    @property
    def line(self) -> str:
        """What changed, for hsx's start-up error line."""
        return (
            f"{vllm_label()} changed what hsx's correctness patch '{self.point.name}' "
            f"({self.point.hsx}) replaces: {self.problem}"
        )


def vllm_label() -> str:
    """``vLLM 0.32.0`` as installed here (``vLLM (not installed)`` without one)."""
    found = installed_vllm()
    return f"vLLM {found[1]}" if found else "vLLM (not installed)"


def host_platform() -> str:
    """``cuda`` where torch sees a CUDA device, else ``cpu`` (as vLLM chooses)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def installed_tree(package: str) -> SourceTree | None:
    """The source this process runs: vLLM's installed package, the standard library,
    or hsx's repository; None where vLLM is not installed. Nothing is imported."""
    if package == "python":
        return SourceTree(Path(os.__file__).parent)
    if package == "hsx":
        return SourceTree(Path(__file__).resolve().parents[3])
    spec = importlib.util.find_spec(package)  # top-level: locates, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    return SourceTree(Path(next(iter(spec.submodule_search_locations))), package)


#: Each checked touch point's problem (None: its fingerprints hold), by name; handed
#: to the engine processes started from the fork server (``adopt``), so they do not
#: read vLLM's source again.
_verified: dict[str, str | None] = {}


def problem_of(point: TouchPoint) -> str | None:
    """What changed in ``point``'s target in the installed source, or None."""
    if point.name not in _verified:
        _verified[point.name] = _first_problem(point)
    return _verified[point.name]


def _first_problem(point: TouchPoint) -> str | None:
    for fingerprint in point.fingerprints:
        tree = installed_tree(fingerprint.package)
        if tree is None:
            return f"{fingerprint.package} is not installed"
        observed = fingerprint.observe(tree)
        if not fingerprint.holds(observed):
            accepted = " or ".join(sorted(set(fingerprint.accepted.values())))
            return f"{fingerprint.describes} {fingerprint.target} is {observed}, not {accepted}"
    return None


def snapshot() -> dict[str, str | None]:
    """The checks made so far in this process, for a process it starts."""
    return dict(_verified)


def adopt(checked: Mapping[str, str | None]) -> None:
    """Take the checks of the process that started this one (same installation)."""
    _verified.update(checked)


def applies(point: TouchPoint) -> bool:
    """Whether to install ``point`` here: this host is one of its platforms, every patch
    it builds on applies, and its fingerprints hold. A performance patch whose target
    changed: False, after one warning line. A correctness one: PatchTargetChanged."""
    if host_platform() not in point.platforms:
        return False
    if not all(applies(required) for required in point.requires):
        return False
    problem = problem_of(point)
    if problem is None:
        return True
    if point.kind is Kind.CORRECTNESS:
        raise PatchTargetChanged(point, problem)
    _warn_once(point.name, problem)
    return False


@functools.cache
def _warn_once(name: str, problem: str) -> None:
    # An engine process would repeat the API process's line on the same console.
    level = logging.WARNING if multiprocessing.parent_process() is None else logging.DEBUG
    log.log(
        level,
        "hsx: performance patch '%s' left off (vLLM's own behaviour runs): %s changed "
        "its target: %s",
        name,
        vllm_label(),
        problem,
    )
