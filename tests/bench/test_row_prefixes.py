"""``python -m benchmarks.run --only`` replaces a bench's rows by its ``ROW_PREFIXES``:
every bench must have them, none may claim another bench's rows, and every row of
``docs/benchmarks.md`` must belong to a bench that ``make bench`` still runs (a row
whose bench moved to ``experiments/`` would otherwise stay in the table forever)."""

from __future__ import annotations

import itertools

from benchmarks.run import ALL_BENCHES, DOC


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


def test_every_published_row_belongs_to_a_bench_of_make_bench() -> None:
    table = DOC.read_text().split("\n\n## ", 1)[0].splitlines()
    names = [
        line.removeprefix("| ")
        for line in table
        if line.startswith("| ") and not line.startswith(("| benchmark |", "| --- |"))
    ]
    assert names, "no rows in docs/benchmarks.md"
    prefixes = tuple(p for bench in ALL_BENCHES for p in bench.ROW_PREFIXES)
    orphans = [name.split(" | ", 1)[0] for name in names if not name.startswith(prefixes)]
    assert not orphans, f"rows of docs/benchmarks.md that no bench writes: {orphans}"
