"""HTTP benchmarks: what the API adds over calling ``Extractor.extract`` in-process.

One engine (the tiny dense demo model on the CPU) serves both sides; each round runs
the in-process batch and the HTTP batch back to back, so drift hits both alike.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.storage_bench import Row, Timer, _ms
from service.config import Settings
from service.engine.builder import served_model_name

NOTES = """- **HTTP vs in-process throughput**: 32 prompts of 32-256 tokens, as 4 concurrent
  `POST /extract` requests of 8 prompts through a real uvicorn server on 127.0.0.1,
  against `asyncio.gather` of the same 32 `Extractor.extract` calls. The row shows the
  times; the ratio is throughput (in-process time / HTTP time), target at least 0.95.
  The client runs in a process of its own (`benchmarks/http_client.py`), as real
  clients do; its request encoding and response parsing count against HTTP.
- **one short prompt, added latency**: a 4-token prompt, one at a time, 30 times each
  way; medians. Target: HTTP adds at most 5 ms.
- **/v1/completions vs /extract**: the same 32 prompts of 32-256 tokens, one prompt
  per request and 32 requests at once, as `speculators generate-offline-data` sends
  them (`prompt` = token ids, `max_tokens=1`, `return_token_ids`), against 32
  one-prompt `POST /extract` requests; both from one client process
  (`benchmarks/paths_client.py`). The ratio is throughput (/extract time / /v1 time),
  target at least 0.95: vLLM's request model and renderer cost little beside the engine.
- **HTTP stack alone**: the same short request against an extractor that answers at
  once, 100 times from the client process: the round trip of uvicorn, FastAPI, auth,
  validation and the client, with no engine competing for the CPU. On a 2-core machine
  the two rows above also measure the client process taking CPU from vLLM's engine
  and worker processes; this row separates what the HTTP stack itself costs.
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _serve(settings: Settings, extractor: Any) -> tuple[Any, asyncio.Task[None], str]:
    import uvicorn

    from service.api.app import create_app

    app = create_app(settings, extractor=extractor)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers a flag, not an event)
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


def bench_settings(scratch: Path, name: str, **limits: Any) -> Settings:
    """The tiny dense demo model (float32, 1 GiB KV cache) and storage under ``scratch``."""
    from service.engine.tiny_models import make_model

    model = make_model(scratch / f"{name}-model", "llama")
    return Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 1024,
            "cpu_kvcache_space_gib": 1,
        },
        storage={"url": str(scratch / f"{name}-objects")},
        limits={"max_prompts": 64, **limits},
    )


async def run(scratch: Path, timer: Timer) -> list[Row]:
    """Throughput and latency rows."""
    from service.engine.extractor import Extractor

    settings = bench_settings(scratch, "api")
    extractor = await Extractor.start(settings)
    server, task, url = await _serve(settings, extractor)
    try:
        return [
            await _throughput(extractor, url, timer, scratch),
            await _latency(extractor, url, timer, scratch),
            await _completions_vs_extract(extractor, url, scratch),
            await _stack_alone(settings, extractor, scratch),
        ]
    finally:
        server.should_exit = True
        await task
        await extractor.close()


async def _http(url: str, bodies: list[Any], repeats: int, scratch: Path) -> list[float]:
    """Wall times of posting ``bodies`` to /extract (``benchmarks.http_client``)."""
    return await _client("benchmarks.http_client", url, bodies, repeats, scratch)


async def _client(
    module: str, url: str, payload: list[Any], repeats: int, scratch: Path
) -> list[float]:
    """Wall times measured by a separate client process, as real clients run."""
    path = scratch / "payload.json"
    path.write_text(json.dumps(payload))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, url, str(path), str(repeats), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, f"{module} failed"
    return [float(t) for t in json.loads(out)]


async def _throughput(extractor: Any, url: str, timer: Timer, scratch: Path) -> Row:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(32, 257))] for _ in range(32)]
    bodies = [{"prompts": [{"token_ids": p} for p in prompts[i : i + 8]]} for i in range(0, 32, 8)]

    async def in_process() -> None:
        await asyncio.gather(*(extractor.extract(p, namespace="bench") for p in prompts))

    await in_process()  # warm-up both paths
    await _http(url, bodies, 1, scratch)
    inproc_t, http_t = [], []
    for _ in range(5):  # alternate, so drift hits both sides
        inproc_t += await timer(in_process, 2)
        http_t += await _http(url, bodies, 2, scratch)
    i, h = statistics.median(inproc_t), statistics.median(http_t)
    return Row(
        "HTTP vs in-process, 32 prompts (ratio: HTTP throughput / in-process)",
        _ms(h),
        _ms(i),
        i / h,
        ">= 0.95",
    )


async def _posts(url: str, requests: list[Any], repeats: int, scratch: Path) -> list[float]:
    """Wall times of posting ``[path, body]`` pairs at once (``benchmarks.paths_client``)."""
    return await _client("benchmarks.paths_client", url, requests, repeats, scratch)


async def _completions_vs_extract(extractor: Any, url: str, scratch: Path) -> Row:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(32, 257))] for _ in range(32)]
    model = served_model_name(extractor.info.name)
    v1 = [
        [
            "/v1/completions",
            {"model": model, "prompt": p, "max_tokens": 1, "return_token_ids": True},
        ]
        for p in prompts
    ]
    extract = [["/extract", {"prompts": [{"token_ids": p}]}] for p in prompts]
    await _posts(url, v1, 1, scratch)  # warm-up both routes (vLLM's renderer included)
    await _posts(url, extract, 1, scratch)
    v1_t, extract_t = [], []
    for _ in range(5):  # alternate, so drift hits both sides
        v1_t += await _posts(url, v1, 2, scratch)
        extract_t += await _posts(url, extract, 2, scratch)
    v, e = statistics.median(v1_t), statistics.median(extract_t)
    return Row(
        "/v1/completions vs /extract, 32 one-prompt requests at once (ratio: throughput)",
        _ms(v),
        _ms(e),
        e / v,
        ">= 0.95",
    )


async def _latency(extractor: Any, url: str, timer: Timer, scratch: Path) -> Row:
    prompt = [5, 6, 7, 8]

    async def in_process() -> None:
        await extractor.extract(prompt, namespace="bench")

    inproc_t, http_t = [], []
    for _ in range(3):
        inproc_t += await timer(in_process, 10)
        http_t += await _http(url, [{"prompts": [{"token_ids": prompt}]}], 10, scratch)
    i, h = statistics.median(inproc_t), statistics.median(http_t)
    target = f"added <= 5 ms (got {(h - i) * 1000:.1f} ms)"
    return Row("one short prompt over HTTP vs in-process (median)", _ms(h), _ms(i), h / i, target)


class _InstantExtractor:
    """Answers at once: what is left of a request's time is the HTTP stack's own."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.tokenizer, self.alive = None, True

    def __getattr__(self, name: str) -> Any:
        # Everything but extract (model facts, codecs, storage, metrics) is the real one's.
        return getattr(self._real, name)

    async def extract(self, ids: list[int], **_: Any) -> Any:
        from service.engine.wire import Extraction

        key = "hsx/default/2026/01/01/" + "0" * 32 + ".safetensors"
        return Extraction(
            key=key,
            uri="file:///x",
            size=1,
            sha256="0" * 64,
            num_tokens=len(ids),
            shape=(len(ids), 3, 128),
            prompt_tokens=len(ids),
            output_token_ids=(1,),
        )


async def _stack_alone(settings: Settings, extractor: Any, scratch: Path) -> Row:
    """The short-prompt request against an instant extractor: HTTP's own round trip."""
    server, task, url = await _serve(settings, _InstantExtractor(extractor))
    try:
        times = await _http(url, [{"prompts": [{"token_ids": [5, 6, 7, 8]}]}], 100, scratch)
    finally:
        server.should_exit = True
        await task
    median = statistics.median(times)
    return Row(
        "HTTP stack alone (instant extractor), median round trip",
        _ms(median),
        "5 ms budget",
        median / 0.005,
        "<= 1.0",
    )
