"""``hsx dataset export``: a run's objects as speculators' trainer reads them
(``--format speculators``), or as OpenAI Batch API output lines (``--format
openai-batch``).

The layout of speculators' ``prepare-data`` + ``data_generation_offline``: a ``datasets``
directory (``save_to_disk``, torch format) with ``input_ids``, ``loss_mask`` and
``seq_len`` per sample, ``hidden_states/hs_{i}.safetensors`` for sample ``i``, and
``token_freq.pt`` (counts of the supervised token ids). ``speculators train --data-path
DIR`` and its ``ArrowDataset`` read it unchanged. Samples are the manifest's ``ok`` rows
in input order; each object is read through the server (decoded here to plain
``hidden_states`` when the run used another codec), and its token ids and mask come
from the object itself, so ids, mask and states cannot disagree.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from service.client import AsyncHsxClient
from service.config import S3StorageSettings
from service.dataset import batch_api
from service.dataset.manifest import Record, load_records
from service.dataset.store import RunStore, write_problem
from service.dataset.verify import run_stores


class ExportError(Exception):
    """The run cannot be exported in this format."""


async def export_speculators_async(
    output: str,
    dest: str | Path,
    endpoint: str,
    api_key: str | None = None,
    concurrency: int = 8,
    s3: S3StorageSettings | None = None,
    allow_partial: bool = False,
) -> int:
    """Write the speculators layout of ``output`` into ``dest``; returns the sample count.

    A run with undecided rows (never sent, or failed retryably) is refused unless
    ``allow_partial``, which exports its ``ok`` rows and says how many are undecided.
    Raises :class:`ExportError` before anything is written.
    """
    dest = Path(dest)
    problem = write_problem(dest)
    if problem is not None:
        raise ExportError(f"export target {dest}: {problem}; export into a new directory")
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"export target {dest}: not empty; export into a new directory")
    root = RunStore(output, s3)
    try:
        samples, input_rows, final = await _samples(root)
    finally:
        await root.close()
    ok = f"{len(samples)} ok rows"
    _check_decided(output, input_rows, final, allow_partial, f"its {ok}", f"the {ok}")
    samples.sort(key=lambda pair: (pair[1].row, pair[1].custom_id))
    from datasets import Dataset  # type: ignore[import-untyped]

    try:
        (dest / "hidden_states").mkdir(parents=True)
    except OSError as exc:
        raise ExportError(f"export target {dest}: {exc.strerror or exc}") from None
    columns: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    async with AsyncHsxClient(endpoint, api_key, timeout=120) as client:
        limit = asyncio.Semaphore(concurrency)

        async def fetch(index: int, codec: str, key: str) -> tuple[list[int], list[int]]:
            async with limit:
                data = await client.get_object(key, decode=codec != "raw")
            target = dest / "hidden_states" / f"hs_{index}.safetensors"
            return await asyncio.to_thread(_write_sample, data, target)

        results = await asyncio.gather(
            *(fetch(i, codec, r.key or "") for i, (codec, r) in enumerate(samples))
        )
    for ids, mask in results:
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        columns["seq_len"].append(len(ids))
    dataset = Dataset.from_dict(columns)
    dataset.set_format(type="torch")
    await asyncio.to_thread(dataset.save_to_disk, str(dest))
    await asyncio.to_thread(_token_freq, columns, dest / "token_freq.pt")
    return len(samples)


async def _samples(root: RunStore) -> tuple[list[tuple[str, Record]], int, int]:
    """The ok rows of every run directory (with their codec), the input's row count
    and how many rows are decided for good."""
    samples: list[tuple[str, Record]] = []
    input_rows, final = 0, 0
    for store, job in await run_stores(root):
        if job.fingerprint.loss == "none":
            raise ExportError(
                f"{store.url}: the run stored no loss masks; run it with --loss for speculators"
            )
        records = await load_records(store)
        samples += [(job.fingerprint.codec, r) for r in records.values() if r.status == "ok"]
        input_rows = max(input_rows, job.input_rows)  # each shard's job counts the whole input
        final += sum(1 for r in records.values() if r.final)
    return samples, input_rows, final


def _write_sample(data: bytes, target: Path) -> tuple[list[int], list[int]]:
    """Save the object's states and token ids as speculators' file; its ids and mask."""
    from safetensors.torch import load, save_file

    tensors = load(data)
    mask = tensors.get("loss_mask")
    if mask is None:
        raise ExportError(f"{target.name}: the object holds no loss_mask")
    save_file(
        {"hidden_states": tensors["hidden_states"], "token_ids": tensors["token_ids"]},
        str(target),
    )
    return [int(t) for t in tensors["token_ids"].tolist()], [int(m) for m in mask.tolist()]


def _token_freq(columns: dict[str, list[Any]], path: Path) -> None:
    """speculators' ``token_freq.pt``: {token id: count} over supervised tokens."""
    import torch

    counts: Counter[int] = Counter()
    for ids, mask in zip(columns["input_ids"], columns["loss_mask"], strict=True):
        counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    torch.save(dict(counts), path)


async def export_openai_batch_async(
    output: str,
    dest: str | Path,
    endpoint: str,
    s3: S3StorageSettings | None = None,
    allow_partial: bool = False,
    storage_url: str | None = None,
) -> int:
    """Write ``output`` as OpenAI Batch API output lines into the file ``dest``: one
    line per ``custom_id`` in input order (an ``ok`` row wins over a duplicate's), with
    the object's ``kv_transfer_params`` as hsx's OpenAI routes answer them, or the
    row's ``error``; returns the line count.

    ``uri`` is the object's storage URI when ``storage_url`` (the server's
    ``HSX_STORAGE__URL``) is given, else where hsx serves it (``ENDPOINT/objects/KEY``):
    the manifest keeps keys, not URIs. Undecided rows are refused unless
    ``allow_partial`` (they get no line). Raises :class:`ExportError` before anything
    is written.
    """
    dest = Path(dest)
    if dest.exists():
        raise ExportError(f"export target {dest}: exists; export into a new file")
    problem = write_problem(dest.parent)
    if problem is not None:
        raise ExportError(f"export target {dest}: {problem}")
    root = RunStore(output, s3)
    try:
        records, input_rows = await _batch_records(root)
    finally:
        await root.close()
    final = sum(1 for _, _, r in records if r.final)
    rows = "the decided rows"
    _check_decided(output, input_rows, final, allow_partial, rows, rows)
    lines = _batch_lines(records, endpoint, storage_url)
    partial = dest.with_name(dest.name + ".partial")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("w", encoding="utf-8") as handle:
            handle.writelines(batch_api.dumps_line(line) for line in lines)
        partial.replace(dest)
    except OSError as exc:
        raise ExportError(f"export target {dest}: {exc.strerror or exc}") from None
    return len(lines)


async def _batch_records(root: RunStore) -> tuple[list[tuple[str, str, Record]], int]:
    """Every decided record of every run directory with its run's model and codec, in
    input order, and the input's row count."""
    records: list[tuple[str, str, Record]] = []
    input_rows = 0
    for store, job in await run_stores(root):
        fingerprint = job.fingerprint
        loaded = await load_records(store)
        records += [(fingerprint.model, fingerprint.codec, r) for r in loaded.values()]
        input_rows = max(input_rows, job.input_rows)
    records.sort(key=lambda triple: (triple[2].row, triple[2].custom_id))
    return records, input_rows


def _batch_lines(
    records: list[tuple[str, str, Record]], endpoint: str, storage_url: str | None
) -> list[dict[str, Any]]:
    """One output line per custom_id: its ok record, else its first row's."""
    chosen: dict[str, tuple[str, str, Record]] = {}
    for model, codec, record in records:
        held = chosen.get(record.custom_id)
        if held is None or (record.status == "ok" and held[2].status != "ok"):
            chosen[record.custom_id] = (model, codec, record)
    order = sorted(chosen.values(), key=lambda triple: triple[2].row)
    lines = []
    for model, codec, record in order:
        params = None
        if record.status == "ok" and record.key:
            if storage_url is not None:
                uri = batch_api.storage_uri(storage_url, record.key)
            else:
                uri = batch_api.object_url(endpoint, record.key)
            local = storage_url is not None and not storage_url.startswith("mooncake://")
            params = batch_api.transfer_params(record, codec, uri, local)
        lines.append(batch_api.output_line(record.custom_id, record, model, params))
    return lines


def _check_decided(
    output: str, input_rows: int, final: int, allow_partial: bool, offer: str, exporting: str
) -> None:
    """ExportError while input rows are undecided, offering ``--allow-partial`` to
    export ``offer``; with it, a warning that ``exporting`` is what goes out."""
    undecided = max(0, input_rows - final)
    if not undecided:
        return
    what = (
        f"{output}: {undecided} of {input_rows} input rows are undecided (not sent yet, "
        "or failed with a retryable error)"
    )
    if not allow_partial:
        raise ExportError(
            f"{what}; finish the run (run the same command again), or pass "
            f"--allow-partial to export {offer}"
        )
    print(f"hsx dataset: warning: {what}; exporting {exporting}", file=sys.stderr, flush=True)
