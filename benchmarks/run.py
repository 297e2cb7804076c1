"""``make bench``: speed measured as ratios, side by side in one run.

Results go to stdout and to ``docs/benchmarks.md``: the table of every bench's rows,
then every bench's ``NOTES``. Each pair runs interleaved on the same data, so a noisy
machine slows both sides alike; the ratio is what we track. Which bench answers which
question: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
from pathlib import Path

from benchmarks import (
    api_bench,
    codec_bench,
    copy_bench,
    dataset_bench,
    drafter_bench,
    engine_bench,
    export_bench,
    parallel_bench,
    real_model_bench,
    regenerate_bench,
    shipped_bench,
    storage_bench,
    validation_bench,
)
from benchmarks.common import Row, loop_factory, table_line, timed

#: Benches on the engine, in the order of the table; each takes ``quick``.
ENGINE_BENCHES = (
    api_bench,
    codec_bench,
    real_model_bench,
    dataset_bench,
    export_bench,
    engine_bench,
    shipped_bench,
    parallel_bench,
    regenerate_bench,
    drafter_bench,
)
#: Every bench whose notes go under the table, in the table's order.
ALL_BENCHES = (storage_bench, validation_bench, copy_bench, *ENGINE_BENCHES)
#: ``--only``'s names for them.
BENCHES = {bench.__name__.rpartition(".")[2]: bench for bench in ALL_BENCHES}

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmarks, written to docs/benchmarks.md.")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized runs: checks every bench works; prints, leaves docs/benchmarks.md",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated bench modules (engine_bench,drafter_bench,...): run just "
        "these and replace their rows in docs/benchmarks.md, keeping the others "
        "(with --quick: print their rows, write nothing)",
    )
    args = parser.parse_args()
    quick, only = args.quick, [name for name in args.only.split(",") if name]
    if unknown := [name for name in only if name not in BENCHES]:
        parser.error(
            f"no bench {', '.join(unknown)}: the benches are {', '.join(BENCHES)} (the "
            "peer and limits benches are experiments now: experiments/README.md)"
        )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    if only:
        _run_only(only, quick)
        return
    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as scratch:
        rows = asyncio.run(storage_bench.run(Path(scratch), timed))
        rows += asyncio.run(validation_bench.run(Path(scratch), timed))
        rows += asyncio.run(copy_bench.run(Path(scratch), timed, quick=quick))
        # The event loop `hsx serve` gets from uvicorn (uvloop when installed), for
        # both sides of the comparison.
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            for bench in ENGINE_BENCHES:
                rows += runner.run(bench.run(Path(scratch), timed, quick=quick))
    if not quick:
        DOC.write_text(_document(rows))


HEADER = [
    "# Benchmarks",
    "",
    "Written by `make bench`. Ratios compare two ways of doing the same work in one run",
    "on the same machine; absolute times depend on the machine (described under the",
    "engine rows below). Where extraction's time goes, and what was tried to cut it:",
    "[profile.md](profile.md). What each bench asks, and how to rerun one:",
    "`benchmarks/README.md`. The `as shipped` rows run `hsx serve` against `vllm serve`",
    "with vLLM's own hidden-states connector, as users start them; the equal-pages",
    "comparison with that connector (every side given hsx's process settings, the cost",
    "of extraction alone) and the machine's limits are experiments, with their last",
    "numbers: `experiments/README.md`.",
    "",
    "| benchmark | ours | baseline | ratio (ours / baseline) | target |",
    "| --- | --- | --- | --- | --- |",
]


def _document(rows: list[Row], kept: list[str] | None = None) -> str:
    """The whole of docs/benchmarks.md: the table (``kept`` lines first), every note."""
    lines = [*HEADER, *(kept or []), *(table_line(row) for row in rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    notes = "".join(module.NOTES for module in ALL_BENCHES)
    return text + "\n" + notes


def _run_only(names: list[str], quick: bool) -> None:
    """Run some benches; their rows replace the rows they wrote before (matched by
    the module's ``ROW_PREFIXES``), every other row of the table stays as it was; with
    ``quick``, print their rows and write nothing."""
    modules = [BENCHES[name] for name in names]
    # Every row a bench writes starts with one of its prefixes: known before it runs.
    prefixes = tuple(p for module in modules for p in module.ROW_PREFIXES)
    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="hsx-bench-") as scratch,
        asyncio.Runner(loop_factory=loop_factory()) as runner,
    ):
        for module in modules:
            rows += runner.run(module.run(Path(scratch), timed, quick=quick))
    if quick:  # it shows the benches run: their rows, nothing written
        print("\n".join(table_line(row) for row in rows))
        return
    old = DOC.read_text().split("\n\n## ", 1)[0].splitlines() if DOC.exists() else []
    kept = [
        line
        for line in old
        if line.startswith("| ")
        and not line.startswith(("| benchmark |", "| --- |"))
        and not line.removeprefix("| ").startswith(prefixes)
    ]
    DOC.write_text(_document(rows, kept))


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
