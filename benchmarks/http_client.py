"""The HTTP side of the API benchmark, in a process of its own, like a real client.

``python -m benchmarks.http_client URL BODIES.json REPEATS``: posts the request bodies
in the file concurrently, REPEATS times in a row, and prints the wall time of each
repeat as a JSON list of seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx


async def main(url: str, bodies: list[object], repeats: int) -> list[float]:
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await client.get("/health")  # connect before timing
        for _ in range(repeats):
            start = time.perf_counter()
            responses = await asyncio.gather(*(client.post("/extract", json=b) for b in bodies))
            times.append(time.perf_counter() - start)
            for response in responses:
                response.raise_for_status()
    return times


if __name__ == "__main__":
    url, path, repeats = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(asyncio.run(main(url, json.loads(path.read_text()), repeats))))
