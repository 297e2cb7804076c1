"""``hsx dataset export --format speculators|specforge|modelopt|eagle``: a finished run's
objects in a trainer's layout, with each trainer's conventions converted (layer ids,
the last layer's norm side, dtypes, file grouping; ``service.dataset.layouts``). Nothing
is extracted again: every ``ok`` row's object is read through the server.

Lifecycle: the run's state is read and checked (decided rows, loss masks, one set of
layer ids, one layer convention) and the layout planned (the layers it needs, refused
in one line when the run lacks them; the target's final norm read from ``--model`` or
the run's model directory when the layout wants the last layer after it) before
anything is written. Objects are then read ``concurrency`` at a time and written in
export order; a row whose exported tensors hold NaN or infinity is left out and listed
in the manifest. Last come the length index (``lengths.jsonl``: sample index, file,
row, ``custom_id``, tokens, loss tokens), the vocabulary maps (``--vocab-map``) and the
manifest ``hsx-export.json``, which says on which side of the final norm the last layer
is; a manifest means a complete export. An export that fails part-way removes what it
wrote.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import shutil
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from service.client import AsyncHsxClient
from service.dataset.export_model import ModelFacts, objects_side, resolve_model
from service.dataset.export_record import Exported, ExportOptions, write_record
from service.dataset.export_sinks import Read, Sink, SpeculatorsSink, TorchSink
from service.dataset.layouts import ExportError, Layout, make_layout, non_finite
from service.dataset.manifest import Job, Record, load_records
from service.dataset.store import RunStore, write_problem
from service.dataset.verify import run_stores

T = TypeVar("T")


async def export_async(
    output: str, dest: str | Path, endpoint: str, options: ExportOptions
) -> Exported:
    """Export the run ``output`` into the new or empty directory ``dest`` (module doc).

    Raises ExportError (one line) before anything is written when the run or the
    options do not allow the layout, and after, removing what it wrote, when an object
    contradicts the run (other layer ids, the other norm side).
    """
    started = time.monotonic()
    dest = Path(dest)
    _check_target(dest)
    if options.compress and options.format != "specforge":
        raise ExportError(f"--compress: only SpecForge reads gzipped files, not {options.format}")
    root = RunStore(output, options.s3)
    try:
        runs = await run_stores(root)
        samples, input_rows, final = await ok_samples(runs)
    finally:
        await root.close()
    ok = f"{len(samples)} ok rows"
    check_decided(output, input_rows, final, options.allow_partial, f"its {ok}", f"the {ok}")
    held, side, convention = _run_layers(runs)
    facts = resolve_model(options.model, runs, needs_model(options), options.vocab_map)
    variant = options.specforge_layout if options.format == "specforge" else None
    layout = make_layout(options.format, variant, held, facts.num_layers, options.aux_layers)
    norm = _norm_for(layout, side, facts)
    created = not dest.exists()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        sink: Sink = (
            SpeculatorsSink(dest)
            if layout.format == "speculators"
            else TorchSink(dest, layout, held, norm, options.compress)
        )
        # torch loads here, not in the first sample's time (seconds of imports).
        await asyncio.to_thread(importlib.import_module, "safetensors.torch")
        writing = time.monotonic()
        done = await _write_samples(samples, sink, held, side, endpoint, options)
        await asyncio.to_thread(sink.finish)
        done.samples_s = time.monotonic() - writing
        done.layout, done.held, done.norm, done.side = layout, held, norm, side
        done.convention = convention
        await asyncio.to_thread(write_record, dest, output, done, facts, options, started)
    except BaseException:
        _remove_written(dest, created)
        raise
    return done


def needs_model(options: ExportOptions) -> bool:
    """Whether the layout needs the target model (its norm or layer count)."""
    if options.format == "speculators":
        return False
    dflash = options.format == "specforge" and options.specforge_layout == "dflash"
    return not (dflash and options.aux_layers is not None)


def _check_target(dest: Path) -> None:
    problem = write_problem(dest)
    if problem is not None:
        raise ExportError(f"export target {dest}: {problem}; export into a new directory")
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"export target {dest}: not empty; export into a new directory")


async def ok_samples(runs: list[tuple[RunStore, Job]]) -> tuple[list[tuple[str, Record]], int, int]:
    """The ok rows of every run directory with their codec, in input order; the input's
    row count; how many rows are decided for good. ExportError for a run without masks."""
    samples: list[tuple[str, Record]] = []
    input_rows, final = 0, 0
    for store, job in runs:
        if job.fingerprint.loss == "none":
            raise ExportError(
                f"{store.url}: the run stored no loss masks; run it with --loss to export it"
            )
        records = await load_records(store)
        samples += [(job.fingerprint.codec, r) for r in records.values() if r.status == "ok"]
        input_rows = max(input_rows, job.input_rows)  # each shard's job counts the whole input
        final += sum(1 for r in records.values() if r.final)
    samples.sort(key=lambda pair: (pair[1].row, pair[1].custom_id))
    return samples, input_rows, final


def check_decided(
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


def _run_layers(runs: list[tuple[RunStore, Job]]) -> tuple[list[int], str, str | None]:
    """The run's layer ids, its objects' norm side for the last layer, and the layer
    convention its server stated; ExportError when its shards disagree."""
    held = {tuple(job.fingerprint.layer_ids) for _, job in runs}
    if len(held) > 1:
        raise ExportError(f"the run's shards hold different layer ids {sorted(held)}")
    conventions = {job.provenance.get("layer_convention") for _, job in runs}
    if len(conventions) > 1:
        raise ExportError("the run's shards state different layer conventions; export each alone")
    convention = conventions.pop()
    return list(held.pop()), objects_side(convention, "the run's job.json"), convention


def _norm_for(layout: Layout, side: str, facts: ModelFacts) -> Any:
    """The final norm to apply to the last layer: only from before to after."""
    wanted = layout.side or ("before" if layout.format == "speculators" else None)
    if wanted is None or wanted == side:
        return None
    if wanted == "before":
        raise ExportError(
            f"the run's objects hold the last layer after the final norm; {layout.name} "
            "reads it before the norm, which cannot be undone; export another layout"
        )
    if facts.norm is None:
        raise ExportError(f"{layout.name} needs the target's final norm; pass --model")
    return facts.norm


async def _write_samples(
    samples: list[tuple[str, Record]],
    sink: Sink,
    held: list[int],
    side: str,
    endpoint: str,
    options: ExportOptions,
) -> Exported:
    """Read, convert and write every sample in order (module docstring)."""
    done = Exported()
    async with AsyncHsxClient(endpoint, options.api_key, timeout=120) as client:

        async def one(codec: str, record: Record) -> tuple[Record, Read, dict[str, Any]]:
            data = await client.get_object(record.key or "", decode=codec != "raw")
            read = await asyncio.to_thread(_read_object, data, record, held, side)
            return record, read, await asyncio.to_thread(sink.prepare, read)

        jobs = (functools.partial(one, codec, record) for codec, record in samples)
        async for record, read, tensors in _in_order(jobs, max(1, options.concurrency)):
            bad = non_finite(tensors)
            if bad:
                done.left_out.append(
                    {
                        "row": record.row,
                        "custom_id": record.custom_id,
                        "key": record.key,
                        "reason": f"non-finite values in {', '.join(bad)}",
                    }
                )
                continue
            name, size = await asyncio.to_thread(sink.write, done.samples, read, tensors)
            done.count(name, size, record, read)
    return done


async def _in_order(jobs: Iterable[Callable[[], Awaitable[T]]], window: int) -> AsyncIterator[T]:
    """The jobs' results in order, ``window`` of them running at once (so memory holds
    at most ``window`` samples, whatever the run's size)."""
    running: deque[asyncio.Future[T]] = deque()
    try:
        for factory in jobs:
            running.append(asyncio.ensure_future(factory()))
            if len(running) >= window:
                yield await running.popleft()
        while running:
            yield await running.popleft()
    finally:
        for task in running:
            task.cancel()


def _read_object(data: bytes, record: Record, held: list[int], side: str) -> Read:
    """The object's tensors, checked against the run: ExportError naming the row."""
    from safetensors.torch import load

    from service.codecs import read_metadata

    where = f"row {record.row} ({record.custom_id})"
    metadata = read_metadata(data)
    if "layer_ids" in metadata and json.loads(metadata["layer_ids"]) != held:
        raise ExportError(
            f"{where}: its object holds layer ids {metadata['layer_ids']}, not {held}"
        )
    convention = metadata.get("hsx.provenance.layer_convention")
    if convention is not None and objects_side(convention, where) != side:
        raise ExportError(
            f"{where}: its object holds the last layer on the other side of the final norm "
            "from the run's; a run of mixed conventions is not exported"
        )
    tensors = load(data)
    states, ids, mask = (tensors.get(k) for k in ("hidden_states", "token_ids", "loss_mask"))
    if states is None or ids is None or mask is None:
        raise ExportError(f"{where}: its object holds no hidden_states, token_ids or loss_mask")
    if states.shape[0] != ids.shape[0]:
        raise ExportError(f"{where}: its object keeps a token selection, not every token")
    return Read(record.custom_id, ids, mask, states)


def _remove_written(dest: Path, created: bool) -> None:
    """Remove what a failed export wrote (``dest`` was new or empty before it)."""
    if created:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for child in dest.iterdir() if dest.is_dir() else []:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
