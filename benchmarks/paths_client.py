"""A client process posting to any routes: ``/extract`` and ``/v1/completions`` alike.

``python -m benchmarks.paths_client URL REQUESTS.json REPEATS``: ``REQUESTS.json`` is a
list of ``[path, body]`` pairs, all posted concurrently (one connection each, as
``generate-offline-data``'s workers do), REPEATS times in a row; prints the wall time of
each repeat as a JSON list of seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


async def main(url: str, requests: list[tuple[str, Any]], repeats: int) -> list[float]:
    limits = httpx.Limits(max_connections=len(requests))
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await client.get("/health")  # connect before timing
        for _ in range(repeats):
            start = time.perf_counter()
            responses = await asyncio.gather(*(client.post(p, json=b) for p, b in requests))
            times.append(time.perf_counter() - start)
            for response in responses:
                response.raise_for_status()
    return times


if __name__ == "__main__":
    url, path, repeats = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(asyncio.run(main(url, json.loads(path.read_text()), repeats))))
