"""The hand-off of one sample: from "the server answered" to "the trainer holds the tensors".

``python -m experiments.storage_handoff.handoff [--quick]``. One sample object, built
as hsx's writer builds it (``codecs.pack_parts("raw", ...)``: float32 states [T, 4, H]
and int64 token ids), is published (untimed) by this process, the server's side, through hsx's
own storage to local disk, to S3 (moto on 127.0.0.1) and to Mooncake (a real
``mooncake_master`` on 127.0.0.1, the object in hs-connectors' layout from
``service.packed``). A trainer in a process of its own (``--trainer``) gets the answer
(the file's path, the S3 key, the Mooncake manifest) and reads the sample the way
speculators' trainer does; only that read is timed, in the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import torch

from benchmarks.common import Row, Timer, free_port, ms
from experiments.common import print_rows

MIB = 1024 * 1024
LAYERS = 4
BUCKET = "hsx-bench"
#: The trainer's ways of reading one sample, in the order of a round's rotation.
PATHS = ("disk", "disk-cold", "s3", "mooncake")
#: The ratio Mooncake's hand-off should reach against local disk at the large size.
TARGET = 0.5

#: The master's command, next to this interpreter (``.venv/bin/mooncake_master``).
MASTER = Path(sys.executable).parent / "mooncake_master"


@dataclass(frozen=True)
class Size:
    """One sample size: ``tokens`` x ``LAYERS`` x ``hidden`` float32 states."""

    label: str
    tokens: int
    hidden: int
    rounds: int
    target: bool = False  # this size's Mooncake / disk ratio carries TARGET

    @property
    def nbytes(self) -> int:
        return self.tokens * LAYERS * self.hidden * 4


FULL = (
    Size("2 MiB", 32, 4096, 20),
    Size("128 MiB", 2048, 4096, 5, target=True),
)
QUICK = (
    Size("32 KiB", 8, 256, 2),
    Size("512 KiB", 128, 256, 2, target=True),
)


# --- the sample ----------------------------------------------------------------------


def sample(size: Size) -> dict[str, torch.Tensor]:
    """The sample of ``size``: the same tensors in the server and in the trainer."""
    generator = torch.Generator().manual_seed(size.nbytes)
    states = torch.randn(size.tokens, LAYERS, size.hidden, generator=generator)
    return {"hidden_states": states, "token_ids": torch.arange(size.tokens, dtype=torch.int64)}


def touch(tensors: dict[str, torch.Tensor]) -> float:
    """Read one element of every 4 KiB page of each tensor (faults a mapped file in)."""
    total = 0.0
    for tensor in tensors.values():
        flat = tensor.reshape(-1).view(torch.uint8)
        total += float(flat[::4096].sum())
    return total


# --- the trainer: a process of its own ------------------------------------------------


def trainer(config: dict[str, Any], answers: IO[str], replies: IO[str]) -> None:
    """Read each answered sample and reply with the read's seconds and its check."""
    import boto3
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    from hs_connectors.transfer import FileTransfer, MooncakeTransfer
    from safetensors.torch import load

    files = FileTransfer(Path(config["scratch"]))
    s3 = boto3.client("s3", endpoint_url=config["endpoint"], region_name="us-east-1")
    mooncake = MooncakeTransfer(
        MooncakeHiddenStatesStore(
            MooncakeStoreConfig(
                local_hostname="127.0.0.1",
                master_server_address=config["master"],
                global_segment_size=0,
                local_buffer_size=config["buffer_bytes"],
            )
        )
    )
    mooncake.setup()
    expected: dict[int, dict[str, torch.Tensor]] = {}

    def read(path: str, answer: Any) -> dict[str, torch.Tensor] | None:
        if path in ("disk", "disk-cold"):
            return files.get_generated({"handle": answer})
        if path == "s3":
            bucket, _, name = answer.removeprefix("s3://").partition("/")
            loaded: dict[str, torch.Tensor] = load(
                s3.get_object(Bucket=bucket, Key=name)["Body"].read()
            )
            return loaded
        return mooncake.get_generated(answer)

    replies.write("ready\n")
    replies.flush()
    for line in answers:
        message = json.loads(line)
        size = Size(**message["size"])
        start = time.perf_counter()
        tensors = read(message["path"], message["answer"])
        assert tensors is not None
        touch(tensors)
        seconds = time.perf_counter() - start
        if size.nbytes not in expected:
            expected.clear()
            expected[size.nbytes] = sample(size)
        want = expected[size.nbytes]
        equal = tensors.keys() == want.keys() and all(
            torch.equal(tensors[name], want[name]) for name in want
        )
        del tensors
        replies.write(json.dumps({"seconds": seconds, "equal": equal}) + "\n")
        replies.flush()


# --- the server's side ------------------------------------------------------------------


def mooncake_missing() -> str | None:
    """Why a Mooncake store cannot run here, or None where it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except (ImportError, OSError) as exc:  # the wheel, or libibverbs1/librdmacm1
        return f"Mooncake's client is not importable: {exc}"
    if not MASTER.is_file():
        return f"no mooncake_master next to {sys.executable}"
    return None


@contextlib.contextmanager
def mooncake_master(log: Path) -> Iterator[str]:
    """A real ``mooncake_master`` on 127.0.0.1: its ``HOST:PORT``; killed on exit."""
    port, metrics = free_port(), free_port()
    with log.open("wb") as out:
        master = subprocess.Popen(  # noqa: S603 - our own binary and ports
            [
                MASTER,
                f"--rpc_port={port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={metrics}",
                "--metrics_host=127.0.0.1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if master.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({master.returncode}): see {log}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not listen on {port}: see {log}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()


class Trainer:
    """The trainer process (``--trainer``): answers in, read times out."""

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self._log = log.open("wb")
        self.process = subprocess.Popen(  # noqa: S603 - this interpreter, this module
            [
                sys.executable,
                "-m",
                "experiments.storage_handoff.handoff",
                "--trainer",
                json.dumps(config),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=Path(__file__).resolve().parents[2],  # the repository root
        )
        self.log = log
        if self._reply() != "ready":
            raise RuntimeError(f"the trainer did not start: see {log}")

    def _reply(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the trainer exited ({self.process.wait()}): see {self.log}")
        return line.strip()

    def read(self, size: Size, path: str, answer: Any) -> float:
        """Seconds the trainer's read of ``answer`` took; RuntimeError if it was wrong."""
        assert self.process.stdin is not None
        message = {"size": size.__dict__, "path": path, "answer": answer}
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self._reply())
        if not reply["equal"]:
            raise RuntimeError(f"the trainer read other tensors than were published ({path})")
        return float(reply["seconds"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def _drop_cache(path: str) -> None:
    """Drop the (clean, fsync'd) file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _rounds(stores: dict[str, Any], trainer: Trainer, size: Size) -> dict[str, float]:
    """Median read seconds of each path at ``size`` over interleaved rounds."""
    from service.codecs import pack_parts
    from service.engine.wire import TransferManifest
    from service.packed import pack
    from service.storage.keys import new_object_key

    tensors = sample(size)
    parts = pack_parts(
        "raw",
        {"hidden_states": tensors["hidden_states"]},
        tensors["token_ids"],
        {"dtype": "float32"},
    )
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for round_ in range(-1, size.rounds):  # -1: the warm-up
        order = PATHS[round_ % len(PATHS) :] + PATHS[: round_ % len(PATHS)]
        for path in order:
            store = stores["disk" if path == "disk-cold" else path]
            key = new_object_key("bench", "handoff")
            answer: Any
            if path == "mooncake":
                packed = pack(parts, key)
                ref = await store.put(key, packed.parts)
                manifest = packed.manifest
                manifest["metadata"]["sha256"] = ref.sha256
                answer = TransferManifest.model_validate(manifest).model_dump(mode="json")
            else:
                ref = await store.put(key, parts)
                answer = urlsplit(ref.uri).path if path.startswith("disk") else ref.uri
                if path == "disk-cold":
                    _drop_cache(answer)
            seconds = await asyncio.to_thread(trainer.read, size, path, answer)
            if round_ >= 0:
                times[path].append(seconds)
            await store.delete(key)
    return {path: statistics.median(values) for path, values in times.items()}


def _rows(size: Size, median: dict[str, float]) -> list[Row]:
    digits = 2 if size.nbytes < 16 * MIB else 1
    shape = f"{size.tokens} tokens x {LAYERS} layers x {size.hidden}, float32"
    what = f"{size.label} sample ({shape}; medians of {size.rounds} interleaved rounds)"
    moon = median["mooncake"]
    rows = []
    for path, baseline in (
        ("disk-cold", "local disk, page cache dropped"),
        ("disk", "local disk, warm page cache"),
    ):
        ratio = moon / median[path]
        if not size.target:
            target = "info"
        elif path == "disk":  # a mapped file in memory: nothing to beat (see notes)
            target = "info (the file is mapped from the page cache, no copy)"
        elif ratio <= TARGET:
            target = f"<= {TARGET}"
        else:
            target = f"<= {TARGET}: not met, measured {ratio:.2f} (see the README)"
        rows.append(
            Row(
                f"hand-off, Mooncake vs {baseline}, {what}",
                ms(moon, digits),
                ms(median[path], digits),
                ratio,
                target,
            )
        )
    rows.append(
        Row(
            f"hand-off, Mooncake vs S3 (moto), {what}",
            ms(moon, digits),
            ms(median["s3"], digits),
            moon / median["s3"],
            "info",
        )
    )
    return rows


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """The hand-off rows: per size, Mooncake against local disk (cold, warm) and S3.
    ``timer`` is not used: the trainer times its reads in its own process."""
    del timer
    missing = mooncake_missing()
    if missing:
        return [
            Row(
                f"hand-off, Mooncake vs local disk and S3: skipped: {missing}",
                "skipped",
                "-",
                0.0,
                "skipped (no Mooncake)",
            )
        ]
    # Imported here: vLLM's spawned workers re-import the benchmark's main module, and
    # moto's flask globals break vLLM's kernel registry scan (werkzeug LocalProxy).
    import boto3
    from moto.server import ThreadedMotoServer

    from service.config import MooncakeStorageSettings, S3StorageSettings, StorageSettings
    from service.storage import open_storage

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request
    sizes = QUICK if quick else FULL
    largest = max(size.nbytes for size in sizes)
    buffer_bytes = max(16 * MIB, 2 * largest)
    work = scratch / "handoff"
    work.mkdir(parents=True, exist_ok=True)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    stores: dict[str, Any] = {}
    trainer: Trainer | None = None
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        with mooncake_master(work / "master.log") as master:
            try:
                stores["disk"] = open_storage(StorageSettings(url=str(work / "objects")))
                s3 = S3StorageSettings(
                    endpoint_url=endpoint,
                    region="us-east-1",
                    multipart_threshold=8 * MIB,
                    part_size=8 * MIB,
                    max_concurrency=8,
                )
                stores["s3"] = open_storage(StorageSettings(url=f"s3://{BUCKET}/handoff", s3=s3))
                mooncake = MooncakeStorageSettings(
                    segment_bytes=max(64 * MIB, 4 * largest), buffer_bytes=buffer_bytes
                )
                stores["mooncake"] = open_storage(
                    StorageSettings(url=f"mooncake://{master}", mooncake=mooncake)
                )
                config = {
                    "scratch": str(work),
                    "endpoint": endpoint,
                    "master": master,
                    "buffer_bytes": buffer_bytes,
                }
                trainer = Trainer(config, work / "trainer.log")
                rows = []
                for size in sizes:
                    rows += _rows(size, await _rounds(stores, trainer, size))
                return rows
            finally:
                if trainer is not None:
                    trainer.close()
                for store in stores.values():
                    await store.close()
    finally:
        server.stop()


def main() -> None:
    """The experiment's rows as table lines (``--quick``: tiny samples); ``--trainer
    CONFIG``: the trainer process, which the experiment starts."""
    if sys.argv[1:2] != ["--trainer"]:
        # moto's S3 takes any credentials; boto3 wants some (benchmarks.run sets the same).
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        print_rows(run, "--quick" in sys.argv[1:], "hsx-handoff-")
        return
    # Replies go out on a descriptor of their own; anything a library prints on
    # stdout goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    trainer(json.loads(sys.argv[2]), sys.stdin, replies)


if __name__ == "__main__":
    main()
