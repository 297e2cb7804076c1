"""Storage benchmarks: what durability and parallel parts cost or gain."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from benchmarks.common import Row, Timer, ms
from service.config import S3StorageSettings, StorageSettings
from service.storage import open_storage
from service.storage.keys import new_object_key

MIB = 1024 * 1024

#: The start of every row this bench writes (``benchmarks.run --only`` replaces them).
ROW_PREFIXES = ("local publish", "S3 multipart")

NOTES = """## What each row measures

- **local publish vs plain write**: `LocalStorage.put` of a 64 MiB object (temp file,
  fsync, link, directory fsync, SHA-256) against `Path.write_bytes` of the same bytes
  with no fsync. The ratio is the price of durability and the checksum.
- **S3 multipart, parallel vs sequential parts**: a 64 MiB object in 8 MiB parts to a
  moto server on 127.0.0.1, `max_concurrency=8` against `max_concurrency=1`. moto is
  CPU-bound on a 2-core machine, so this understates the gain against a real store,
  where each part waits on the network.
"""


def _data(size: int) -> bytes:
    return hashlib.shake_256(b"bench").digest(size)


async def _local(scratch: Path, timer: Timer) -> Row:
    data = _data(64 * MIB)
    storage = open_storage(StorageSettings(url=str(scratch / "objects")))
    plain = scratch / "plain.bin"

    async def ours() -> object:
        return await storage.put(new_object_key("bench", "local"), data)

    async def baseline() -> object:
        return await asyncio.to_thread(plain.write_bytes, data)

    ours_t, base_t = [], []
    for _ in range(5):  # interleaved, so drift hits both sides
        ours_t += await timer(ours, 1)
        base_t += await timer(baseline, 1)
    await storage.close()
    o, b = sorted(ours_t)[2], sorted(base_t)[2]
    return Row("local publish (fsync+sha256) vs plain write, 64 MiB", ms(o), ms(b), o / b, "info")


async def _s3(timer: Timer) -> Row:
    # Imported here: vLLM's spawned workers re-import the benchmark's main module, and
    # moto's flask globals break vLLM's kernel registry scan (werkzeug LocalProxy).
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket="hsx-bench"
    )
    data = _data(64 * MIB)

    def settings(concurrency: int) -> StorageSettings:
        s3 = S3StorageSettings(
            endpoint_url=endpoint,
            region="us-east-1",
            multipart_threshold=8 * MIB,
            part_size=8 * MIB,
            max_concurrency=concurrency,
        )
        return StorageSettings(url="s3://hsx-bench/bench", s3=s3)

    parallel, sequential = open_storage(settings(8)), open_storage(settings(1))
    par_t, seq_t = [], []
    for _ in range(3):
        par_t += await timer(lambda: parallel.put(new_object_key("b", "p"), data), 1)
        seq_t += await timer(lambda: sequential.put(new_object_key("b", "s"), data), 1)
    await parallel.close()
    await sequential.close()
    server.stop()
    p, s = sorted(par_t)[1], sorted(seq_t)[1]
    return Row("S3 multipart 64 MiB: 8 parallel parts vs 1 (moto)", ms(p), ms(s), p / s, "<= 1.0")


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """All storage rows (``quick`` changes nothing: they are short)."""
    return [await _local(scratch, timer), await _s3(timer)]
