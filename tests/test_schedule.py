"""``make test``'s scheduler puts every test of a group on one worker.

pytest-xdist's own ``--dist loadgroup`` stopped grouping under pytest 9 (it rewrites
``item._nodeid``, which pytest 9 no longer reads): every test became a group of its
own, and a module's engine fixture started again on each worker its tests reached.
"""

from __future__ import annotations

from tests.support.schedule import PACKAGE_GROUPS, GroupScheduling, group_of

NODES = [
    "tests/engine/test_codecs_engine.py::test_every_codec_round_trips_through_storage[llama]",
    "tests/engine/test_codecs_engine.py::test_bad_codec[nemotron-h-kwargs0-choose one of raw, fp8]",
    "tests/api/test_extract.py::test_one",
    "tests/api/test_openai.py::test_two[a@b]",
    "tests/e2e/test_bench_smoke.py::test_quick_bench_gives_well_formed_rows[codec_bench]",
    "tests/e2e/test_bench_smoke.py::test_quick_bench_gives_well_formed_rows[api_bench]",
]


def test_the_scheduler_splits_by_our_groups() -> None:
    scheduler = GroupScheduling.__new__(GroupScheduling)  # its scopes need no workers
    scheduler._packages = PACKAGE_GROUPS
    scopes = [scheduler._split_scope(node) for node in NODES]
    assert scopes == [group_of(node) for node in NODES]
    # a module together, a package together, the bench smoke tests one by one
    assert scopes[0] == scopes[1] == "tests/engine/test_codecs_engine.py"
    assert scopes[2] == scopes[3] == "tests/api/"
    assert scopes[4] != scopes[5]


def test_a_run_without_engines_groups_by_module() -> None:
    scheduler = GroupScheduling.__new__(GroupScheduling)
    scheduler._packages = ()  # what __init__ chooses for -m "not engine ..."
    scopes = [scheduler._split_scope(node) for node in NODES]
    assert scopes[2] == "tests/api/test_extract.py"
    assert scopes[3] == "tests/api/test_openai.py"
    assert scopes[0] == scopes[1] == "tests/engine/test_codecs_engine.py"
