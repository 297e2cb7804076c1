"""``python -m benchmarks.run --only`` replaces a bench's rows by its ``ROW_PREFIXES``:
every bench must have them, and none may claim another bench's rows."""

from __future__ import annotations

import itertools

from benchmarks.run import ALL_BENCHES


def test_every_bench_names_its_rows() -> None:
    for bench in ALL_BENCHES:
        prefixes = bench.ROW_PREFIXES
        assert isinstance(prefixes, tuple), bench.__name__
        assert prefixes, bench.__name__
        assert all(isinstance(p, str) and p.strip() for p in prefixes), bench.__name__


def test_no_bench_claims_another_benchs_rows() -> None:
    for one, other in itertools.permutations(ALL_BENCHES, 2):
        for mine, theirs in itertools.product(one.ROW_PREFIXES, other.ROW_PREFIXES):
            assert not theirs.startswith(mine), (one.__name__, mine, other.__name__, theirs)
