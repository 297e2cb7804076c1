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
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def wait_for_lock(path: str) -> bool:
    """Block until the writer of ``path`` has released ``<path>.lock``; whether there
    was such a lock (as speculators checks, before it waits)."""
    if not os.path.exists(path + ".lock"):
        return False
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    return True


async def _worker(
    client: httpx.AsyncClient, model: str, pending: Any, counts: dict[str, int]
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
        if await asyncio.to_thread(wait_for_lock, path):
            counts["locked"] += 1


async def run_set(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Every prompt of ``spec`` through ``spec["in_flight"]`` workers; the wall time."""
    workers = int(spec["in_flight"])
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    counts = {"files": 0, "locked": 0}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        (await client.get("/health")).raise_for_status()  # connected before the clock
        pending = iter(spec["prompts"])
        start = time.perf_counter()
        await asyncio.gather(
            *(_worker(client, spec["model"], pending, counts) for _ in range(workers))
        )
        seconds = time.perf_counter() - start
    return {"seconds": seconds, **counts}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[2]).read_text())
    print(json.dumps(asyncio.run(run_set(sys.argv[1], spec))))
