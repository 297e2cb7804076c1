"""Every bench of ``make bench`` runs end to end in quick mode and gives well-formed rows.

Benchmark modules break quietly when the code they drive changes; this runs each bench
(the engine bench: three engines, moto, the transformers pipeline) on the tiny model and
checks the rows' shape only: no time or ratio is asserted, speed lives in the bench.
They check the benches, not hsx, so they run first in ``make bench`` (``make
bench-smoke``) and not in ``make test`` (the ``bench_smoke`` marker). The drafter
pipeline keeps one smaller run in ``make test``: ``tests/e2e/test_drafter_smoke.py``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks import engine_bench
from benchmarks.common import timed

pytestmark = [pytest.mark.bench_smoke, pytest.mark.engine, pytest.mark.slow]


async def test_quick_engine_bench_gives_every_row(tmp_path: Path, aws_env: None) -> None:
    rows = await engine_bench.run(tmp_path, timed, quick=True)

    sets = [f"{count}x{length} tokens" for length, count in engine_bench.QUICK.sets]
    others = [
        "same engine without extraction",
        "vanilla vLLM (no spec. method, no connector)",
        "transformers pipeline",
    ]
    names = [
        f"extraction vs {other}, {size}, {where} (ratio: throughput)"
        for where in ("local disk", "S3 (moto)")
        for size in sets
        for other in others
    ]
    assert [row.name for row in rows[:-1]] == names
    assert all(row.name.startswith(engine_bench.ROW_PREFIXES) for row in rows), rows
    for row in rows[:-1]:
        assert math.isfinite(row.ratio), row
        assert row.ratio > 0, row
        assert re.fullmatch(r"[1-9]\d* tok/s", row.ours), row
        assert re.fullmatch(r"[1-9]\d* tok/s", row.baseline), row
    targets = [row.target for row in rows[:-1]]
    local, s3 = targets[:6], targets[6:]
    assert local == [">= 0.95", "info", ">= 1.0"] * 2
    assert s3 == ["info"] * 6

    rss = rows[-1]
    assert "peak RSS growth" in rss.name
    assert re.fullmatch(r"\d+ MiB", rss.ours), rss
    ceiling, margin = engine_bench.QUICK.in_flight_mib, engine_bench.RSS_MARGIN_MIB
    assert rss.baseline == f"{ceiling} + {margin} MiB"
    assert rss.ratio == pytest.approx(int(rss.ours.split()[0]) / (ceiling + margin), abs=0.01)


async def test_quick_shipped_bench_gives_a_row_per_set(tmp_path: Path) -> None:
    """`hsx serve` and `vllm serve` with vLLM's connector, one start each on the tiny
    model: one row per set, each naming both sides' throughput and CPU by process."""
    from benchmarks import shipped_bench

    rows = await shipped_bench.run(tmp_path, timed, quick=True)

    plan = shipped_bench.QUICK
    assert [row.name.split(" (ratio", 1)[0] for row in rows] == [
        f"as shipped: hsx serve vs vllm serve + its connector, {model.label}, {s.name}"
        for model in plan.models
        for s in plan.sets
    ]
    for row in rows:
        assert re.fullmatch(r"[1-9]\d* tok/s", row.ours), row
        assert re.fullmatch(r"[1-9]\d* tok/s", row.baseline), row
        ours, baseline = (int(text.split()[0]) for text in (row.ours, row.baseline))
        assert row.ratio == pytest.approx(ours / baseline, abs=0.01), row
        assert row.target == ">= 1.0"
        # Both servers did the work: each side's worker spent CPU on the set.
        cpu = row.name.split("CPU s per set: ", 1)[1]
        assert re.search(r"hsx: .*worker \d+\.\d", cpu), row
        assert re.search(r"vLLM: .*worker \d+\.\d", cpu), row


@pytest.mark.parametrize(
    "name",
    [
        "api_bench",
        "codec_bench",
        "real_model_bench",
        "dataset_bench",
        "export_bench",
        "copy_bench",
        "parallel_bench",
    ],
)
async def test_quick_bench_gives_well_formed_rows(
    name: str, tmp_path: Path, aws_env: None, demo_model: Path
) -> None:
    """Every other bench of ``make bench`` in its quick mode: rows, not speed. (The real
    model's bench uses the demo model, prepared once per machine by the fixture.)"""
    import importlib

    bench = importlib.import_module(f"benchmarks.{name}")
    rows = await bench.run(tmp_path, timed, quick=True)
    assert rows, name
    for row in rows:
        assert all((row.name, row.ours, row.baseline, row.target)), row
        assert math.isfinite(row.ratio), row
        assert row.ratio >= 0, row
        # `--only` replaces a bench's rows by these prefixes: every row must carry one.
        assert row.name.startswith(bench.ROW_PREFIXES), row


async def test_storage_and_validation_benches_give_well_formed_rows(
    tmp_path: Path, aws_env: None
) -> None:
    from benchmarks import storage_bench, validation_bench

    rows = await storage_bench.run(tmp_path, timed) + await validation_bench.run(tmp_path, timed)
    assert len(rows) == 3
    prefixes = storage_bench.ROW_PREFIXES + validation_bench.ROW_PREFIXES
    assert all(row.name.startswith(prefixes) for row in rows), rows
    for row in rows:
        assert math.isfinite(row.ratio), row
        assert row.ratio > 0, row


# Five engines, four trainings and a transformers reference on 2 cores: about 8 minutes
# beside the other worker's tests, more on a machine shared with other jobs.
@pytest.mark.timeout(1200)
async def test_quick_drafter_bench_gives_every_row(
    tmp_path: Path, aws_env: None, demo_model: Path
) -> None:
    """The drafter proof end to end at its quick size (hsx dataset run and export,
    speculators train per arm, scoring, vLLM's EAGLE-3 acceptance): rows, not scores."""
    from benchmarks import drafter_bench

    rows = await drafter_bench.run(tmp_path, timed, quick=True)
    assert len(rows) == 7
    for row in rows:
        assert row.name.startswith(drafter_bench.ROW_PREFIXES), row
        assert math.isfinite(row.ratio), row
    for row in rows[:4]:  # arms (a)-(d): top-1 at steps 0, 1 and 2
        assert re.fullmatch(r"\d\.\d{3} / \d\.\d{3} / \d\.\d{3}", row.ours), row
    assert "not measured" not in rows[5].ours, rows[5]  # vLLM's acceptance length ran


async def test_quick_regenerate_bench_gives_its_row(tmp_path: Path, demo_model: Path) -> None:
    """One pass (``hsx dataset run --regenerate``) against speculators' two passes on the
    demo model, at the quick size: one row with both arms' wall time and forward tokens
    per conversation, every answer of every conversation generated by both."""
    from benchmarks import regenerate_bench

    rows = await regenerate_bench.run(tmp_path, timed, quick=True)

    assert len(rows) == 1
    row = rows[0]
    assert row.name.startswith(regenerate_bench.ROW_PREFIXES), row
    for side in (row.ours, row.baseline):
        assert re.fullmatch(r"\d+\.\d s, [1-9]\d* fwd tok/conv", side), row
    seconds = [float(side.split(" s,")[0]) for side in (row.ours, row.baseline)]
    assert row.ratio == pytest.approx(seconds[0] / seconds[1], abs=0.01), row
    size = regenerate_bench.QUICK
    answers = size.conversations * size.turns
    assert f"({answers} vs {answers} answers, " in row.name, row
    generated = re.search(r"generated (\d+) vs (\d+)", row.name)
    assert generated is not None, row
    assert int(generated[1]) == int(generated[2]) > 0, row  # the same greedy answers
