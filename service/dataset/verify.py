"""``hsx dataset verify``: every ``ok`` row of the manifest against its object.

Each object is read back once through the server (``GET /objects/{key}``; S3 answers
with a presigned redirect) and checked, decoded here by ``service.codecs`` whatever its
codec: it exists, its SHA-256 is the manifest's, its tensors
have the fingerprint's shape and the manifest's token count, its states are finite,
its ``loss_mask`` holds the manifest's supervised count, and, for rows given as token
ids, its token ids are the input's.

Across a run directory it also checks that no row's mean token norm is an outlier of
its layer (``service.dataset.statistics``) and that every object carries the same
``hsx.provenance.*`` metadata (unless mixed provenance is allowed). On request
(:class:`Checks`) it compares a sample with transformers (``service.dataset.parity``)
and re-renders a sample of ``messages`` rows (``service.dataset.drift``; a
``--regenerate`` run's, the conversations it wrote: ``service.dataset.regenerated``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.client import AsyncHsxClient
from service.config import S3StorageSettings
from service.dataset.inputs import iter_rows, open_source
from service.dataset.manifest import Job, Record, load_job, load_records
from service.dataset.objects import decode_tensors, fetch, provenance_of
from service.dataset.statistics import OUTLIER_Z, outliers
from service.dataset.store import RunStore

if TYPE_CHECKING:
    from service.dataset.parity import ParityReport


@dataclass(frozen=True)
class Checks:
    """What ``verify`` checks beyond each object's own checks (the CLI's flags)."""

    #: Rows compared with transformers (0: no parity check).
    parity: int = 0
    #: Path or Hugging Face id of the served model (default: ``model_choice``'s).
    parity_model: str | None = None
    parity_seed: int = 0
    parity_device: str = "cpu"
    #: A relative-error bound per layer, whatever the run's dtype (parity's norm rule).
    #: None: ``parity.rule_for`` and ``parity.bound_for`` the run's dtype and codec (a
    #: half-precision run is held to transformers' own gap from float32).
    parity_tolerance: float | None = None
    #: ``messages`` rows re-rendered for token drift (None: as many as ``parity``).
    drift: int | None = None
    allow_mixed_provenance: bool = False
    outlier_z: float = OUTLIER_Z

    @property
    def drift_rows(self) -> int:
        return self.parity if self.drift is None else self.drift


@dataclass
class Checked:
    """One object's verdict, and what the run-wide checks need from it."""

    problem: str | None = None
    #: Median token norm per stored layer (the outlier check's measure).
    norms: list[float] | None = None
    provenance: dict[str, str] | None = None


@dataclass
class VerifyReport:
    """What verify found, per shard directory merged."""

    checked: int = 0
    problems: list[str] = field(default_factory=list)
    rows: int = 0
    failed: int = 0
    skipped: int = 0
    #: Messages rows re-rendered for token drift.
    drift_checked: int = 0
    parity: ParityReport | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and (self.parity is None or self.parity.ok)

    def text(self) -> str:
        head = (
            f"verified {self.checked} objects of {self.rows} manifest rows "
            f"({self.failed} failed, {self.skipped} skipped rows): "
            f"{len(self.problems)} problems"
        )
        lines = [head, *self.problems[:50]]
        if self.drift_checked:
            lines.append(f"token drift: re-rendered {self.drift_checked} messages rows")
        if self.parity is not None:
            lines += self.parity.lines()
        return "\n".join(lines)


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
    checks: Checks | None = None,
) -> VerifyReport:
    """Check every object the output's manifest names; see the module docstring.

    With ``checks.parity``, ``parity.json`` is written into the output.
    """
    checks = checks or Checks()
    report = VerifyReport()
    root = RunStore(output, s3)
    try:
        async with AsyncHsxClient(endpoint, api_key, timeout=120) as client:
            runs = await run_stores(root)
            model = await _model(checks, runs) if checks.parity else None  # refuse early
            for store, job in runs:
                await _check_run(client, store, job, report, concurrency, check_input, checks)
            if checks.drift_rows:
                await _check_drift(client, runs, report, checks, model)
            if checks.parity:
                from service.dataset.parity import parity_check

                report.parity = await parity_check(
                    client,
                    root,
                    runs,
                    checks.parity,
                    model=model,
                    seed=checks.parity_seed,
                    device=checks.parity_device,
                    tolerance=checks.parity_tolerance,
                )
    finally:
        await root.close()
    return report


async def _model(checks: Checks, runs: list[tuple[RunStore, Job]]) -> str:
    """The model parity and token drift load (``model_choice``: never a directory
    that merely shares the served name); ParityError when there is none."""
    from service.dataset.model_choice import choose_model

    return await asyncio.to_thread(choose_model, checks.parity_model, runs)


async def _check_drift(
    client: AsyncHsxClient,
    runs: list[tuple[RunStore, Job]],
    report: VerifyReport,
    checks: Checks,
    model: str | None,
) -> None:
    """Token drift of each run directory's sampled messages rows (one tokenizer load);
    a ``--regenerate`` run's rows against the conversations it wrote, not its input."""
    from service.dataset import regenerated
    from service.dataset.drift import drift_check, load_tokenizer, message_rows

    def regenerating(job: Job) -> bool:
        return job.fingerprint.regenerate is not None

    if not any(regenerating(job) or message_rows(job) for _, job in runs):
        return  # no messages rows (or no readable input): nothing to load a tokenizer for
    model = model or await _model(checks, runs)
    tokenizer = await asyncio.to_thread(load_tokenizer, model)
    for store, job in runs:
        check = regenerated.drift_check if regenerating(job) else drift_check
        found = await check(client, store, job, tokenizer, checks.drift_rows, checks.parity_seed)
        report.drift_checked += found.checked
        report.problems += found.problems


async def _check_run(
    client: AsyncHsxClient,
    store: RunStore,
    job: Job,
    report: VerifyReport,
    concurrency: int,
    check_input: bool,
    checks: Checks,
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
    checked = await _check_all(client, job, ok, inputs, report, concurrency)
    norms = {row: c.norms for row, c in checked.items() if c.norms is not None}
    report.problems += outliers(norms, job.fingerprint.layer_ids, checks.outlier_z)
    if not checks.allow_mixed_provenance:
        report.problems += mixed_provenance(store, checked)


async def _check_all(
    client: AsyncHsxClient,
    job: Job,
    records: list[Record],
    inputs: dict[int, list[int]],
    report: VerifyReport,
    concurrency: int,
) -> dict[int, Checked]:
    limit = asyncio.Semaphore(concurrency)
    checked: dict[int, Checked] = {}

    async def one(record: Record) -> None:
        async with limit:
            result = await _check(client, job, record, inputs.get(record.row))
        report.checked += 1
        checked[record.row] = result
        if result.problem:
            report.problems.append(f"row {record.row} ({record.key}): {result.problem}")

    await asyncio.gather(*(one(r) for r in records))
    return checked


def mixed_provenance(store: RunStore, checked: dict[int, Checked]) -> list[str]:
    """One line if the run's objects do not all carry the same provenance metadata."""
    groups: dict[str, list[int]] = {}
    for row, result in sorted(checked.items()):
        if result.provenance is not None:
            groups.setdefault(json.dumps(result.provenance, sort_keys=True), []).append(row)
    if len(groups) < 2:
        return []
    kinds = [json.loads(text) for text in groups]
    differing = sorted({k for kind in kinds for k in kind if len({d.get(k) for d in kinds}) > 1})
    sizes = ", ".join(f"{len(rows)} rows (first: row {rows[0]})" for rows in groups.values())
    return [
        f"{store.url}: objects of {len(groups)} provenances ({sizes}) differ in "
        f"{', '.join(differing)}; pass --allow-mixed-provenance to accept them"
    ]


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
) -> Checked:
    data, problem = await fetch(client, record)
    if data is None:
        return Checked(problem)
    return await asyncio.to_thread(_check_tensors, data, job, record, ids)


def _check_tensors(data: bytes, job: Job, record: Record, ids: list[int] | None) -> Checked:
    try:
        tensors = decode_tensors(data, job.fingerprint.codec)
        provenance = provenance_of(data)
    except Exception as exc:
        return Checked(f"not a safetensors object: {exc}")
    problem = _tensor_problem(tensors, job, record, ids)
    if problem is not None:
        return Checked(problem, provenance=provenance)
    states = tensors["hidden_states"].double()
    norms = states.norm(dim=-1).median(dim=0).values.tolist() if states.shape[0] else None
    return Checked(None, norms, provenance)


def _tensor_problem(
    tensors: dict[str, Any], job: Job, record: Record, ids: list[int] | None
) -> str | None:
    import torch

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
