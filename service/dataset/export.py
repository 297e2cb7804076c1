"""``hsx dataset export``: a run's objects as speculators' trainer reads them
(``--format speculators``), or as OpenAI Batch API output lines (``--format
openai-batch``). SpecForge, ModelOpt and EAGLE layouts, and what every trainer export
writes beside its samples (``hsx-export.json``, ``lengths.jsonl``, vocabulary maps):
``service.dataset.trainer_export``.

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

from pathlib import Path
from typing import Any

from service.config import S3StorageSettings
from service.dataset import batch_api
from service.dataset.layouts import ExportError
from service.dataset.manifest import Record, load_records
from service.dataset.store import RunStore, write_problem
from service.dataset.trainer_export import check_decided
from service.dataset.verify import run_stores

__all__ = ["ExportError", "export_openai_batch_async", "export_speculators_async"]


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
    Raises :class:`ExportError` before anything is written. The other layouts, the
    manifest and the length index: ``service.dataset.trainer_export``.
    """
    from service.dataset.export_record import ExportOptions
    from service.dataset.trainer_export import export_async

    options = ExportOptions(
        api_key=api_key, concurrency=concurrency, s3=s3, allow_partial=allow_partial
    )
    return (await export_async(output, dest, endpoint, options)).samples


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
    check_decided(output, input_rows, final, allow_partial, rows, rows)
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
