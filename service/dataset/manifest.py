"""The run's records: ``job.json`` (fingerprint), the manifest, errors and the summary.

The manifest is the only source of "done": one JSON line per decided row, appended
after that row's object is durable (``ok``) or once the row is known to be unusable
(``skipped``, ``failed``). The last line of a row wins, so a retryable failure followed
by a later success reads as a success. Objects are never listed to find what is done.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.client.models import LayerStatistics
from service.dataset.store import RunStore

Status = Literal["ok", "skipped", "failed"]
JOB = "job.json"
SUMMARY = "summary.json"
MANIFEST = "manifest"
ERRORS = "errors"
#: ``--regenerate``: one line per ok row, its conversation as regenerated.
REGENERATED = "regenerated"


class FingerprintMismatchError(Exception):
    """An output holds a run with other settings."""


class Fingerprint(BaseModel):
    """What makes two runs produce the same objects; a resume must match it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    codec: str
    tokenizer_sha256: str | None = None
    chat_template_sha256: str | None = None
    loss: str
    max_length: int
    on_long: str
    max_tokens: int
    include_output_tokens: bool
    hsx_version: str
    shard: str | None = None
    #: ``--regenerate``'s sampling settings and seed (None: the rows' own answers).
    regenerate: dict[str, float | int] | None = None


class Job(BaseModel):
    """``job.json``: the fingerprint, where the run reads from, and what made the states."""

    fingerprint: Fingerprint
    input: str
    input_rows: int
    created: float = Field(default_factory=time.time)
    provenance: dict[str, str] = Field(
        default_factory=dict,
        description="The server's provenance (GET /v1/models) when the run started: "
        "versions, weights_sha256, layer convention; empty from servers without it.",
    )


class Record(BaseModel):
    """One manifest line."""

    model_config = ConfigDict(extra="ignore")

    row: int
    custom_id: str
    status: Status
    key: str | None = None
    num_tokens: int | None = None
    num_loss_tokens: int | None = None
    bytes: int | None = None
    sha256: str | None = None
    found: bool | None = None
    reason: str | None = None
    retryable: bool = False
    statistics: LayerStatistics | None = Field(
        None, description="The object's per-layer sums, as the server returned them."
    )
    forward_tokens: int | None = Field(
        None, description="--regenerate: tokens the target ran forward for the row."
    )
    recomputed_tokens: int | None = Field(
        None,
        description="--regenerate: tokens computed again because the prefix cache had "
        "lost an earlier turn's blocks (the states are right; the pass cost more).",
    )

    @property
    def final(self) -> bool:
        """Decided for good: a resume does not send this row again."""
        return self.status != "failed" or not self.retryable


async def load_job(store: RunStore) -> Job | None:
    """The output's ``job.json``, or None for a new output."""
    data = await store.read(JOB)
    return Job.model_validate_json(data) if data is not None else None


async def check_fingerprint(store: RunStore, wanted: Fingerprint, force: bool) -> None:
    """Refuse an output whose run had another fingerprint (unless ``force``)."""
    job = await load_job(store)
    if job is None or job.fingerprint == wanted or force:
        return
    old, new = job.fingerprint.model_dump(), wanted.model_dump()
    diff = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in old if old[k] != new[k])
    raise FingerprintMismatchError(
        f"{store.url} holds a run with other settings ({diff}); "
        "use another --output, or --force to continue it anyway"
    )


#: The provenance key whose change refuses a resume: other weights, other states.
WEIGHTS = "weights_sha256"


async def check_provenance(store: RunStore, served: dict[str, str], force: bool) -> None:
    """Refuse to resume a run against a server with other weights (unless ``force``).

    Only ``weights_sha256`` refuses: versions may change under a long run (verify
    reports objects of mixed provenance), other weights may not. A side that does not
    know its hash (an older server or run) cannot be compared and passes.
    """
    job = await load_job(store)
    if job is None or force:
        return
    old, new = job.provenance.get(WEIGHTS), served.get(WEIGHTS)
    if old is None or new is None or old == new:
        return
    raise FingerprintMismatchError(
        f"{store.url} was run against weights {WEIGHTS} {old[:16]}..., but the server "
        f"serves {new[:16]}...; use another --output, or --force to continue it anyway"
    )


async def load_records(store: RunStore) -> dict[int, Record]:
    """The last manifest line of every row."""
    records: dict[int, Record] = {}
    for line in await store.lines(MANIFEST):
        record = Record.model_validate_json(line)
        records[record.row] = record
    return records


def error_line(record: Record, attempts: int = 0) -> str:
    """An ``errors.jsonl`` line for a skipped or failed row."""
    return json.dumps(
        {
            "row": record.row,
            "custom_id": record.custom_id,
            "status": record.status,
            "reason": record.reason,
            "retryable": record.retryable,
            "attempts": attempts,
            "time": round(time.time(), 3),
        }
    )


class Summary(BaseModel):
    """``summary.json``: ok + failed + skipped (+ pending, for a stopped run) = rows."""

    input_rows: int
    ok: int
    failed: int
    skipped: int
    pending: int
    complete: bool
    tokens: int
    loss_tokens: int
    bytes: int
    objects_created: int
    objects_found: int
    reasons: dict[str, int]
    stopped: str | None = None
    elapsed_s: float = Field(0.0, description="Wall time of the last session.")


def summarise(
    records: dict[int, Record], input_rows: int, stopped: str | None, elapsed_s: float = 0.0
) -> Summary:
    """Counts over the rows of this run (its shard) from their manifest lines."""
    counts: Counter[str] = Counter(r.status for r in records.values())
    ok = [r for r in records.values() if r.status == "ok"]
    reasons = Counter((r.reason or "").split(":")[0] for r in records.values() if r.status != "ok")
    decided = counts["ok"] + counts["failed"] + counts["skipped"]
    return Summary(
        input_rows=input_rows,
        ok=counts["ok"],
        failed=counts["failed"],
        skipped=counts["skipped"],
        pending=input_rows - decided,
        complete=decided == input_rows
        and not any(not r.final for r in records.values())
        and stopped is None,
        tokens=sum(r.num_tokens or 0 for r in ok),
        loss_tokens=sum(r.num_loss_tokens or 0 for r in ok),
        bytes=sum(r.bytes or 0 for r in ok),
        objects_created=sum(1 for r in ok if not r.found),
        objects_found=sum(1 for r in ok if r.found),
        reasons=dict(sorted(reasons.items())),
        stopped=stopped,
        elapsed_s=round(elapsed_s, 3),
    )


def dumps(model: BaseModel) -> bytes:
    return (model.model_dump_json(indent=2) + "\n").encode()
