"""``hsx dataset verify``: every ``ok`` row of the manifest against its object.

Each object is read back through the server (``GET /objects/{key}``; S3 answers with a
presigned redirect) and checked: it exists, its SHA-256 is the manifest's, its tensors
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

from service.dataset.endpoints import auth_headers
from service.dataset.inputs import iter_rows, open_source
from service.dataset.manifest import Job, Record, load_job, load_records
from service.dataset.store import StateStore, open_store


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


def run_stores(output: str, s3_endpoint_url: str | None = None) -> list[tuple[StateStore, Job]]:
    """The output's run directories: the output itself, or its ``shard-*`` children."""
    root = open_store(output, s3_endpoint_url)
    job = load_job(root)
    if job is not None:
        return [(root, job)]
    found = []
    for name in root.children():
        child = root.child(name)
        child_job = load_job(child)
        if child_job is not None:
            found.append((child, child_job))
    if not found:
        raise FileNotFoundError(f"{output}: no job.json (not the output of hsx dataset run)")
    return found


async def verify_async(
    output: str,
    endpoint: str,
    api_key: str | None = None,
    concurrency: int = 8,
    s3_endpoint_url: str | None = None,
    check_input: bool = True,
) -> VerifyReport:
    """Check every object the output's manifest names; see the module docstring."""
    report = VerifyReport()
    async with httpx.AsyncClient(
        headers=auth_headers(api_key), timeout=120, follow_redirects=True
    ) as client:
        for store, job in run_stores(output, s3_endpoint_url):
            records = await asyncio.to_thread(load_records, store)
            inputs = _input_ids(job) if check_input else {}
            report.rows += len(records)
            report.failed += sum(1 for r in records.values() if r.status == "failed")
            report.skipped += sum(1 for r in records.values() if r.status == "skipped")
            keys = [r.key for r in records.values() if r.status == "ok"]
            if len(set(keys)) != len(keys):
                report.problems.append(f"{store.url}: a key appears on two rows")
            ok = [r for r in records.values() if r.status == "ok"]
            await _check_all(client, endpoint, job, ok, inputs, report, concurrency)
    return report


async def _check_all(
    client: httpx.AsyncClient,
    endpoint: str,
    job: Job,
    records: list[Record],
    inputs: dict[int, list[int]],
    report: VerifyReport,
    concurrency: int,
) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(record: Record) -> None:
        async with limit:
            problem = await _check(client, endpoint, job, record, inputs.get(record.row))
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
    client: httpx.AsyncClient, endpoint: str, job: Job, record: Record, ids: list[int] | None
) -> str | None:
    url = f"{endpoint.rstrip('/')}/objects/{record.key}"
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        return f"cannot read: {exc}"
    if response.status_code != 200:
        return f"GET answered {response.status_code}"
    data = response.content
    if hashlib.sha256(data).hexdigest() != record.sha256:
        return "checksum differs from the manifest"
    if job.fingerprint.codec != "raw":
        decoded = await client.get(url, params={"decode": "true"})
        if decoded.status_code != 200:
            return f"GET ?decode=true answered {decoded.status_code}"
        data = decoded.content
    return await asyncio.to_thread(_check_tensors, data, job, record, ids)


def _check_tensors(data: bytes, job: Job, record: Record, ids: list[int] | None) -> str | None:
    import torch
    from safetensors.torch import load

    try:
        tensors: dict[str, Any] = load(data)
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
