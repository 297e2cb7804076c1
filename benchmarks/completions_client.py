"""The as-shipped bench's client: token-id prompts to ``/v1/completions``, in a process
of its own, the same for ``hsx serve`` and ``vllm serve``.

``python -m benchmarks.completions_client URL SET.json``: ``SET.json`` is
``{"model": NAME, "prompts": [[token ids], ...], "in_flight": N}``. ``N`` workers (one
connection each) post one prompt at a time (``max_tokens`` 1, greedy); each answer must
name its stored states in ``kv_transfer_params.hidden_states_path``. Where a
``<path>.lock`` exists (vLLM's connector writes the file after it answers) the worker
waits for ``LOCK_SH`` on it before it takes its next prompt, as speculators'
``generate-offline-data`` and vLLM's ``load_hidden_states`` wait; hsx answers once the
object is durable and writes no lock. Prints ``{"seconds": wall time of the set,
"files": answers that named a file, "locked": of those, how many had a lock}``.

Two things keep the client from measuring itself: each worker waits for its lock on a
thread of its own (asyncio's default pool has ``min(32, CPUs + 4)`` threads, and a
worker queued behind others' lock waits would hold its connection idle), and an idle
connection is dropped after ``KEEPALIVE_EXPIRY_S``, before the server's keep-alive
timeout (uvicorn's 5 s, both servers) can close it under a request just sent on it: with
httpx's default expiry of the same 5 s, a run of ``vllm serve`` failed once on
``httpx.ReadError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

#: Seconds an idle connection is kept: under the servers' keep-alive timeout of 5 s.
KEEPALIVE_EXPIRY_S = 1.0


def wait_for_lock(path: str) -> bool:
    """Block until the writer of ``path`` has released ``<path>.lock``; whether there
    was such a lock (as speculators checks, before it waits)."""
    if not os.path.exists(path + ".lock"):
        return False
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    return True


async def _worker(
    client: httpx.AsyncClient,
    model: str,
    pending: Any,
    counts: dict[str, int],
    waits: concurrent.futures.Executor,
) -> None:
    for prompt in pending:  # one shared iterator: each prompt is taken once
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        answer = await client.post("/v1/completions", json=body)
        answer.raise_for_status()
        params = answer.json().get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise RuntimeError(f"the answer named no stored states: {answer.text[:500]}")
        counts["files"] += 1
        if await asyncio.get_running_loop().run_in_executor(waits, wait_for_lock, path):
            counts["locked"] += 1


async def run_set(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Every prompt of ``spec`` through ``spec["in_flight"]`` workers; the wall time."""
    workers = int(spec["in_flight"])
    limits = httpx.Limits(
        max_connections=workers,
        max_keepalive_connections=workers,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    counts = {"files": 0, "locked": 0}
    waits = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lock-wait")
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        (await client.get("/health")).raise_for_status()  # connected before the clock
        pending = iter(spec["prompts"])
        start = time.perf_counter()
        await asyncio.gather(
            *(_worker(client, spec["model"], pending, counts, waits) for _ in range(workers))
        )
        seconds = time.perf_counter() - start
    waits.shutdown()
    return {"seconds": seconds, **counts}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[2]).read_text())
    print(json.dumps(asyncio.run(run_set(sys.argv[1], spec))))
