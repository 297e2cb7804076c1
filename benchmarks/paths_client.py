"""The client side of the API benchmarks, in a process of its own, like a real client.

``python -m benchmarks.paths_client URL BATCHES.json [WORKERS]``: ``BATCHES.json`` is a
list of batches, each a list of ``[path, body]`` pairs (``/extract`` and
``/v1/completions`` alike). The batches run one after another; the pairs of one batch
are posted by ``WORKERS`` concurrent workers (one connection each, each posting its next
pair once its last was answered, as ``generate-offline-data``'s workers do), or all at
once when ``WORKERS`` is not given. Prints the wall time of each batch as a JSON list of
seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


async def _post_all(client: httpx.AsyncClient, batch: list[Any], workers: int) -> None:
    """Post every pair of ``batch`` through ``workers`` workers; raise on any non-2xx."""
    pending = iter(batch)

    async def worker() -> None:
        for path, body in pending:  # one shared iterator: each pair is taken once
            (await client.post(path, json=body)).raise_for_status()

    await asyncio.gather(*(worker() for _ in range(workers)))


async def main(url: str, batches: list[list[Any]], workers: int | None) -> list[float]:
    most = workers or max(len(b) for b in batches)
    times = []
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await client.get("/health")  # connect before timing
        for batch in batches:
            start = time.perf_counter()
            await _post_all(client, batch, workers or len(batch))
            times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    url, path = sys.argv[1], Path(sys.argv[2])
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    print(json.dumps(asyncio.run(main(url, json.loads(path.read_text()), workers))))
