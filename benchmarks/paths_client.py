"""The client side of the API benchmarks, in a process of its own, like a real client.

``python -m benchmarks.paths_client URL BATCHES.json``: ``BATCHES.json`` is a list of
batches, each a list of ``[path, body]`` pairs (``/extract`` and ``/v1/completions``
alike). The pairs of one batch are posted concurrently (one connection each, as
``generate-offline-data``'s workers do), the batches one after another; prints the
wall time of each batch as a JSON list of seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


async def main(url: str, batches: list[list[tuple[str, Any]]]) -> list[float]:
    limits = httpx.Limits(max_connections=max(len(b) for b in batches))
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await client.get("/health")  # connect before timing
        for batch in batches:
            start = time.perf_counter()
            responses = await asyncio.gather(*(client.post(p, json=b) for p, b in batch))
            times.append(time.perf_counter() - start)
            for response in responses:
                response.raise_for_status()
    return times


if __name__ == "__main__":
    url, path = sys.argv[1], Path(sys.argv[2])
    print(json.dumps(asyncio.run(main(url, json.loads(path.read_text())))))
