"""Each request of a set as the client sees it: when it was posted, answered and done
(the object durable, or vLLM's file lock released), on both servers.

``python -m experiments.as_shipped_profile.timeline --models 1024 --sets 64x256@8``:
the as-shipped bench's servers (one start each, hsx then vLLM, warmed up as the bench
warms them), one round of each set through an in-process client that keeps the bench
client's rules (``benchmarks.completions_client``: N workers, one prompt each, the next
once the last is done) and times every request. Prints, per side and set, the
throughput, the median per request of post to answer and answer to done (the object
durable, or vLLM's file lock released), and the engine steps the set took (vLLM's
``vllm:iteration_tokens_total``: how many, their mean tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import shipped_bench
from benchmarks.completions_client import KEEPALIVE_EXPIRY_S, wait_for_lock
from benchmarks.shipped_servers import HSX, VLLM, Server, running
from experiments.as_shipped_profile.profile_servers import latency_sums, plan_of, steps_between


async def timed_set(server: Server, prompts: list[list[int]], in_flight: int) -> list[list[float]]:
    """``[posted, answered, done]`` seconds from the set's start, per request."""
    limits = httpx.Limits(
        max_connections=in_flight,
        max_keepalive_connections=in_flight,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    found: list[list[float]] = []
    waits = concurrent.futures.ThreadPoolExecutor(in_flight)
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        (await client.get("/health")).raise_for_status()
        pending = iter(prompts)
        start = time.perf_counter()

        async def worker() -> None:
            for prompt in pending:
                body = {
                    "model": server.model,
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0.0,
                }
                posted = time.perf_counter() - start
                answer = await client.post("/v1/completions", json=body)
                answer.raise_for_status()
                answered = time.perf_counter() - start
                path = answer.json()["kv_transfer_params"]["hidden_states_path"]
                await loop.run_in_executor(waits, wait_for_lock, path)
                found.append([posted, answered, time.perf_counter() - start])

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    waits.shutdown()
    return found


def per_request(times: list[list[float]]) -> dict[str, float]:
    """Median milliseconds per request: post to answer, and answer to done (the durable
    object, or vLLM's lock released)."""
    answer = [a - p for p, a, _ in times]
    done = [d - a for _, a, d in times]
    return {
        "post to answer": 1e3 * statistics.median(answer),
        "answer to done": 1e3 * statistics.median(done),
    }


async def measure(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    plan = plan_of(args)
    found = []
    for model in plan.models:
        spec = await asyncio.to_thread(shipped_bench.server_spec, model, scratch)
        for side in (HSX, VLLM):
            async with running(side, spec, scratch, f"timeline-{side}") as server:
                for length in sorted({s.length for s in plan.sets}):
                    warm = shipped_bench.prompts_for(
                        shipped_bench.PromptSet(4, length, 4), f"warm-{side}"
                    )
                    await shipped_bench.run_client(server, warm, 4, scratch)
                for prompt_set in plan.sets:
                    prompts = shipped_bench.prompts_for(prompt_set, "timeline")
                    before = await latency_sums(server.url)
                    times = await timed_set(server, prompts, prompt_set.in_flight)
                    seconds = max(t[2] for t in times)
                    row = {"model": model.label, "side": side, "set": prompt_set.name}
                    row |= {"tok/s": round(prompt_set.tokens / seconds)}
                    row |= {k: round(v, 1) for k, v in per_request(times).items()}
                    found_steps = steps_between(before, await latency_sums(server.url))
                    row |= {"steps": found_steps["count"]}
                    row |= {"tokens a step": round(found_steps["mean_tokens"])}
                    print(row, flush=True)
                    found.append(row)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sets", help="only these sets, e.g. 64x256@8")
    parser.add_argument("--models", help="only the models whose label contains this")
    args = parser.parse_args()
    args.rounds, args.order = 1, None
    with tempfile.TemporaryDirectory(prefix="hsx-timeline-") as scratch:
        asyncio.run(measure(args, Path(scratch)))


if __name__ == "__main__":
    main()
