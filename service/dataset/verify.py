"""``hsx dataset verify``: every ``ok`` row of the manifest against its object.

Each object is read back once through the server (``GET /objects/{key}``; S3 answers
with a presigned redirect) and checked, decoded here by ``service.codecs`` whatever its
codec: it exists, its SHA-256 is the manifest's, its tensors
have the fingerprint's shape and the manifest's token count, its states are finite,
its ``loss_mask`` holds the manifest's supervised count, and, for rows given as token
ids, its token ids are the input's.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.client import AsyncHsxClient, HsxError
from service.config import S3StorageSettings
from service.dataset.inputs import iter_rows, open_source
from service.dataset.manifest import Job, Record, load_job, load_records
from service.dataset.store import RunStore


@dataclass
class VerifyReport:
    """What verify found, per shard directory merged."""

    checked: int = 0
    problems: list[str] = field(default_factory=list)
    rows: int = 0
    failed: int = 0
    skipped: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"verified {self.checked} objects of {self.rows} manifest rows "
            f"({self.failed} failed, {self.skipped} skipped rows): "
            f"{len(self.problems)} problems"
        )
        return "\n".join([head, *self.problems[:50]])


async def run_stores(root: RunStore) -> list[tuple[RunStore, Job]]:
    """The output's run directories: the output itself, or its ``shard-*`` children."""
    job = await load_job(root)
    if job is not None:
        return [(root, job)]
    found = []
    for name in await root.children():
        child = root.child(name)
        child_job = await load_job(child)
        if child_job is not None:
            found.append((child, child_job))
    if not found:
        raise FileNotFoundError(f"{root.url}: no job.json (not the output of hsx dataset run)")
    return found


async def verify_async(
    output: str,
    endpoint: str,
    api_key: str | None = None,
    concurrency: int = 8,
    s3: S3StorageSettings | None = None,
    check_input: bool = True,
) -> VerifyReport:
    """Check every object the output's manifest names; see the module docstring."""
    report = VerifyReport()
    root = RunStore(output, s3)
    try:
        async with AsyncHsxClient(endpoint, api_key, timeout=120) as client:
            for store, job in await run_stores(root):
                await _check_run(client, store, job, report, concurrency, check_input)
    finally:
        await root.close()
    return report


async def _check_run(
    client: AsyncHsxClient,
    store: RunStore,
    job: Job,
    report: VerifyReport,
    concurrency: int,
    check_input: bool,
) -> None:
    records = await load_records(store)
    inputs = _input_ids(job) if check_input else {}
    report.rows += len(records)
    report.failed += sum(1 for r in records.values() if r.status == "failed")
    report.skipped += sum(1 for r in records.values() if r.status == "skipped")
    keys = [r.key for r in records.values() if r.status == "ok"]
    if len(set(keys)) != len(keys):
        report.problems.append(f"{store.url}: a key appears on two rows")
    ok = [r for r in records.values() if r.status == "ok"]
    await _check_all(client, job, ok, inputs, report, concurrency)


async def _check_all(
    client: AsyncHsxClient,
    job: Job,
    records: list[Record],
    inputs: dict[int, list[int]],
    report: VerifyReport,
    concurrency: int,
) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(record: Record) -> None:
        async with limit:
            problem = await _check(client, job, record, inputs.get(record.row))
        report.checked += 1
        if problem:
            report.problems.append(f"row {record.row} ({record.key}): {problem}")

    await asyncio.gather(*(one(r) for r in records))


def _input_ids(job: Job) -> dict[int, list[int]]:
    """Token ids of the input's token-id rows (empty if the input is not readable now)."""
    try:
        source = open_source(job.input)
    except Exception:
        return {}
    return {
        row.index: row.prompt["token_ids"]
        for row in iter_rows(source)
        if row.prompt is not None and "token_ids" in row.prompt
    }


async def _check(
    client: AsyncHsxClient, job: Job, record: Record, ids: list[int] | None
) -> str | None:
    try:
        data = await client.get_object(record.key or "")
    except httpx.HTTPError as exc:
        return f"cannot read: {exc}"
    except HsxError as exc:
        return f"GET answered {exc.status}"
    if hashlib.sha256(data).hexdigest() != record.sha256:
        return "checksum differs from the manifest"
    return await asyncio.to_thread(_check_tensors, data, job, record, ids)


def _tensors(data: bytes, codec: str) -> dict[str, Any]:
    """The object's tensors, its states in the model dtype whatever the codec."""
    if codec == "raw":
        from safetensors.torch import load

        return dict(load(data))
    from service.codecs import decode

    return dict(decode(data)[0])


def _check_tensors(data: bytes, job: Job, record: Record, ids: list[int] | None) -> str | None:
    import torch

    try:
        tensors = _tensors(data, job.fingerprint.codec)
    except Exception as exc:
        return f"not a safetensors object: {exc}"
    states, tokens = tensors.get("hidden_states"), tensors.get("token_ids")
    if states is None or tokens is None:
        return "no hidden_states or token_ids"
    fp = job.fingerprint
    want = (record.num_tokens, len(fp.layer_ids), fp.hidden_size)
    if tuple(states.shape) != want or tuple(tokens.shape) != (record.num_tokens,):
        return f"shape {tuple(states.shape)} / {tuple(tokens.shape)}, expected {want}"
    if not bool(torch.isfinite(states).all()):
        return "hidden_states hold NaN or Inf"
    shared = min(len(ids or []), int(record.num_tokens or 0))  # truncated, or with outputs
    if ids is not None and tokens.tolist()[:shared] != ids[:shared]:
        return "token_ids differ from the input row"
    if record.num_loss_tokens is not None:
        mask = tensors.get("loss_mask")
        if mask is None or int(mask.sum()) != record.num_loss_tokens:
            return "loss_mask missing or its count differs from the manifest"
    return None
