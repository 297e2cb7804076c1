"""How ``make test`` shares the suite between two pytest-xdist workers.

Most of the suite's time is vLLM starting: the engine core and its worker each import
vLLM and torch in a fresh process, one after the other, on one core. Two workers keep
both cores busy. Tests that share an engine (a module's fixture, ``tests/api``'s
package fixture, the security server) must stay on one worker, so every test has a
group (``group_of``): its module by default, a whole package where a fixture spans it,
the test alone where a module's tests share nothing costly; ``GroupScheduling`` hands
each group whole to one worker. Heavy groups go first, so the last minutes are not one
long group on one worker while the other idles.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

#: Path prefixes that form one group (their tests share a fixture wider than a module).
PACKAGE_GROUPS = ("tests/api/", "tests/e2e/security/")
#: Modules whose tests share nothing costly: each test is its own group.
PER_TEST = ("tests/e2e/test_bench_smoke.py",)
#: Groups sent first, longest first: seconds of one run of the suite on 2 cores beside
#: other work (load about 4), engine-starting groups all. ``make test``'s first, then
#: ``make test-system``'s (marker system), then ``make bench-smoke``'s: each run keeps
#: the order of those it selects.
HEAVY_FIRST = (
    "tests/api/",  # 240 (one tiny engine for the package; regeneration on it)
    "tests/e2e/test_readme.py",  # 135 (a fresh clone converts the demo model itself)
    "tests/e2e/security/",  # 115
    "tests/e2e/test_model_startup_errors.py",  # 105
    "tests/engine/test_wrapped_families.py",  # 100 (two hsx serve: Falcon-H1, Gemma 3)
    "tests/e2e/test_startup_errors.py",  # 70
    "tests/storage/test_s3.py",  # 65
    "tests/dataset/test_parity.py",  # 45
    "tests/dataset/test_export_layouts.py",  # 40
    "tests/engine/test_qwen3_next.py",  # 40 (a bfloat16 engine, two transformers forwards)
    "tests/engine/test_hybrid_s3.py",  # 35
    "tests/engine/test_codecs_engine.py",  # 30
    # make test-system
    "tests/engine/test_demo_model.py",  # 175 (SmolLM2 engine, transformers, regeneration)
    "tests/e2e/test_serve.py",  # 150 (three hsx serve)
    "tests/e2e/test_speculators.py",  # 125
    "tests/dataset/test_dataset_e2e.py",  # 115
    "tests/engine/test_parallel.py",  # 80 (three engines, one after the other)
    "tests/engine/test_prestart.py",  # 75 (three processes importing vLLM)
    "tests/e2e/test_mooncake_trust.py",  # 65
    "tests/e2e/test_prometheus.py",  # 50
    "tests/e2e/test_drafter_smoke.py",  # 45 (one engine, one training)
    # make bench-smoke
    "tests/e2e/test_bench_smoke.py::test_quick_drafter_bench_gives_every_row",  # 145
    "tests/e2e/test_bench_smoke.py::test_quick_bench_gives_well_formed_rows[parallel_bench]",  # 37
    "tests/e2e/test_bench_smoke.py::test_quick_engine_bench_gives_every_row",  # 15
)


def group_of(nodeid: str, packages: tuple[str, ...] = PACKAGE_GROUPS) -> str:
    """The group of the test ``nodeid`` (``GroupScheduling``'s scope for it); the
    prefixes of ``packages`` each form one group."""
    path = nodeid.split("::", 1)[0]
    for prefix in packages:
        if path.startswith(prefix):
            return prefix
    if path in PER_TEST:
        return nodeid
    return path


def _rank(item: pytest.Item) -> int:
    group = group_of(item.nodeid)
    for rank, heavy in enumerate(HEAVY_FIRST):
        if group == heavy or group.startswith(heavy):
            return rank
    return len(HEAVY_FIRST)


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """pytest-xdist's scope scheduler with our groups as its scopes: every test of a
    group goes to one worker, groups in collection order (``--no-loadscope-reorder``).

    ``--dist loadgroup`` alone does not group under pytest 9: pytest-xdist 3.8 marks a
    test's group by appending it to ``item._nodeid``, which pytest 9 no longer reads
    (``Node.nodeid`` comes from ``_id``), so every test was a group of its own and a
    module's engine fixture started again on each worker its tests reached.

    A run that leaves out the engine tests (``-m "not engine ..."``, ``make test-fast``)
    groups by module only: the packages' shared fixtures are their engines, and the
    fast tests of ``tests/api`` alone would otherwise keep one worker busy to the end.
    """

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        engines = "not engine" not in (config.getoption("markexpr", "") or "")
        self._packages = PACKAGE_GROUPS if engines else ()

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid, self._packages)


def heavy_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, put the heavy groups first: the workers' collection order is the
    order ``GroupScheduling`` hands groups out in (a stable sort, so the order inside a
    group, which some modules rely on, is kept)."""
    if hasattr(config, "workerinput"):
        items.sort(key=_rank)


#: What the workers measured and the controller prints: tests.engine.checks.WORST merged.
GATHERED_WORST: dict[str, float] = {}


def send_worker_results(session: pytest.Session) -> None:
    """On an xdist worker: hand the worst relative errors it saw to the controller (the
    engine tests' summary line would otherwise print in a worker nobody reads)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is None:
        return
    import sys

    checks = sys.modules.get("tests.engine.checks")  # only where engine tests ran
    workeroutput["hsx_worst"] = dict(getattr(checks, "WORST", {}))


def gather_worker_results(node: object) -> None:
    """On the controller: merge one finished worker's results."""
    for model, error in getattr(node, "workeroutput", {}).get("hsx_worst", {}).items():
        GATHERED_WORST[model] = max(GATHERED_WORST.get(model, 0.0), error)


def print_gathered(terminalreporter: object) -> None:
    """On the controller: the worst relative errors, as a serial run prints them."""
    for model, error in sorted(GATHERED_WORST.items()):
        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"hsx: worst relative error vs transformers, {model}: {error:.2e}"
        )
