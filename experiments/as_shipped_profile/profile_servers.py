"""Where each server's time goes in the as-shipped comparison: every set's CPU seconds by
process and thread, and the mean of every latency histogram the server exports.

``python -m experiments.as_shipped_profile.profile_servers --models 1024 --sets
64x256@8 --record FILE`` (``--rounds``, ``--order hsx`` for one side;
``--writers-anywhere``: hsx's writer threads on every CPU, ``writers_anywhere/``): the as-shipped
bench's servers, plan and client (``benchmarks.shipped_bench``), with each set wrapped
in a read of the servers' threads and ``/metrics`` before and after. The README says
what it found.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks import shipped_bench
from benchmarks.common import table_line
from benchmarks.shipped_bench import FULL, QUICK, Plan, PromptSet, run_client
from benchmarks.shipped_servers import Server, server_processes

#: vLLM's histogram of the tokens each engine step scheduled (both servers export it).
STEP_TOKENS = "vllm:iteration_tokens_total"


async def latency_sums(url: str) -> dict[str, list[float]]:
    """``[sum, count]`` so far of every ``*_seconds`` histogram the server exports at
    ``/metrics`` (labels summed): hsx's extract, copy, write and storage durations,
    vLLM's request, queue, prefill and inference times; and of ``STEP_TOKENS``."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        text = (await client.get("/metrics")).text
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        wanted = family.name.endswith("_seconds") or family.name == STEP_TOKENS
        if family.type != "histogram" or not wanted:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                pair = found.setdefault(family.name, [0.0, 0.0])
                pair[sample.name.endswith("_count")] += sample.value
    return found


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of every thread of the server ``pid`` and its descendants,
    summed by ``role/thread name`` as the kernel names them (hsx names its pool threads:
    ``service/threads.py``; OpenMP's team threads keep their process's name)."""
    import psutil

    found: dict[str, float] = {}
    for process, role in server_processes(pid):
        with contextlib.suppress(psutil.Error, OSError):
            for thread in process.threads():
                with contextlib.suppress(OSError):
                    name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
                    key = f"{role}/{name}"
                    found[key] = found.get(key, 0.0) + thread.user_time + thread.system_time
    return found


async def profiled_client(
    server: Server, prompts: list[list[int]], in_flight: int, scratch: Path
) -> dict[str, Any]:
    """The bench's client on one set, with the CPU seconds each thread of the server
    spent (``threads``) and the mean seconds per observation of every latency histogram
    (``latency_s``) during the set."""
    latencies, threads = await latency_sums(server.url), thread_cpu(server.pid)
    result = await run_client(server, prompts, in_flight, scratch)
    after_threads, after_latencies = thread_cpu(server.pid), await latency_sums(server.url)
    result["threads"] = {
        k: round(v - threads.get(k, 0.0), 3)
        for k, v in after_threads.items()
        if v - threads.get(k, 0.0) > 0.005
    }
    result["latency_s"] = {
        name: (total - latencies.get(name, [0.0, 0.0])[0]) / count
        for name, (total, all_count) in after_latencies.items()
        if (count := all_count - latencies.get(name, [0.0, 0.0])[1]) > 0 and name != STEP_TOKENS
    }
    result["steps"] = steps_between(latencies, after_latencies)
    return result


def steps_between(
    before: dict[str, list[float]], after: dict[str, list[float]]
) -> dict[str, float]:
    """The engine's steps between two :func:`latency_sums`: how many, and the mean
    tokens each scheduled."""
    total, count = (
        a - b
        for a, b in zip(
            after.get(STEP_TOKENS, [0.0, 0.0]), before.get(STEP_TOKENS, [0.0, 0.0]), strict=True
        )
    )
    return {"count": count, "mean_tokens": total / count if count else 0.0}


def plan_of(args: argparse.Namespace) -> Plan:
    """The bench's plan (``--quick``: its quick one), narrowed by the command line."""
    plan = QUICK if args.quick else FULL
    models, sets, rounds, order = plan.models, plan.sets, plan.rounds, plan.order
    if args.sets:  # COUNTxLENGTH@IN_FLIGHT,...
        sets = tuple(
            PromptSet(int(count), int(length), int(in_flight))
            for text in args.sets.split(",")
            for shape, in_flight in [text.split("@")]
            for count, length in [shape.split("x")]
        )
    if args.models:
        models = tuple(m for m in models if args.models in m.label)
    return Plan(
        models, sets, args.rounds or rounds, tuple(args.order.split(",")) if args.order else order
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--record", type=Path, help="every round's numbers, as JSON")
    parser.add_argument("--sets", help="only these sets, e.g. 64x256@8 (COUNTxLENGTH@IN_FLIGHT)")
    parser.add_argument("--models", help="only the models whose label contains this")
    parser.add_argument("--rounds", type=int, help="rounds per start")
    parser.add_argument("--order", help="the starts, e.g. hsx,vLLM")
    parser.add_argument(
        "--writers-anywhere",
        action="store_true",
        help="hsx's writer threads on every CPU, not off the forward pass's (a variant)",
    )
    args = parser.parse_args(argv)
    if args.writers_anywhere:  # hsx's processes inherit it; vLLM's side sets its own
        os.environ["PYTHONPATH"] = str(Path(__file__).with_name("writers_anywhere"))
    with tempfile.TemporaryDirectory(prefix="hsx-shipped-profile-") as scratch:
        rows, recorded = asyncio.run(
            shipped_bench.measure(plan_of(args), Path(scratch), profiled_client)
        )
    if args.record is not None:
        args.record.write_text(json.dumps(recorded, indent=1))
    print("\n".join(table_line(row) for row in rows))


if __name__ == "__main__":
    main()
