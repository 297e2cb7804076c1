"""Token drift: stored token ids of ``messages`` rows against a fresh render.

A conversation's token ids are the server's render of it with its chat template. A
template or tokenizer changed under a run (another revision of the model, a patched
template, a server started with ``--chat-template``) silently changes what the states
mean. ``verify`` re-renders a sample of the run's ``messages`` rows on this machine
with the model's own tokenizer and template, exactly as ``/extract`` renders them
(:func:`service.masks.conversation_ids`), and reports every row whose stored ids
differ, and a template whose SHA-256 is not the one pinned in ``job.json``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.dataset.inputs import iter_rows, open_source
from service.dataset.manifest import Job, Record

if TYPE_CHECKING:
    from service.client import AsyncHsxClient
    from service.dataset.store import RunStore


@dataclass
class DriftReport:
    """Rows compared and what differed."""

    checked: int = 0
    problems: list[str] = field(default_factory=list)


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer (and chat template) from a path or Hugging Face id."""
    from transformers import AutoTokenizer

    from service.dataset.model_choice import ParityError

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise ParityError(
            f"cannot load the tokenizer of {model!r} ({type(exc).__name__}); pass "
            "--parity-model with the served model's path or Hugging Face id"
        ) from None


def template_problem(tokenizer: Any, job: Job) -> str | None:
    """A line if the tokenizer's chat template is not the one ``job.json`` pins."""
    pinned = job.fingerprint.chat_template_sha256
    template = getattr(tokenizer, "chat_template", None)
    digest = hashlib.sha256(template.encode()).hexdigest() if template else None
    if pinned is None or digest == pinned:
        return None
    return (
        f"token drift: chat template SHA-256 {str(digest)[:12]}... differs from the run's "
        f"{pinned[:12]}... (job.json)"
    )


def message_rows(job: Job) -> dict[int, dict[str, Any]]:
    """The input's ``messages`` prompts by row (empty if the input is not readable now)."""
    try:
        source = open_source(job.input)
    except Exception:
        return {}
    return {
        row.index: row.prompt
        for row in iter_rows(source)
        if row.prompt is not None and "messages" in row.prompt
    }


def pick(records: dict[int, Record], prompts: dict[int, Any], k: int, seed: int) -> list[Record]:
    """Up to ``k`` ``ok`` records of messages rows, drawn by ``seed``."""
    ok = sorted(
        (r for r in records.values() if r.status == "ok" and r.row in prompts),
        key=lambda r: r.row,
    )
    return ok if k >= len(ok) else random.Random(seed).sample(ok, k)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter's length when one
    is a prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def differs(stored: list[int], rendered: list[int], with_outputs: bool) -> str | None:
    """Where the stored ids leave the render (None: they agree)."""
    head = stored[: len(rendered)] if with_outputs else stored
    if head == rendered:
        return None
    same = first_difference(head, rendered)
    return (
        f"token drift: stored token ids ({len(stored)}) differ from the chat template's "
        f"render ({len(rendered)}) from position {same}"
    )


async def drift_check(
    client: AsyncHsxClient,
    store: RunStore,
    job: Job,
    tokenizer: Any,
    k: int,
    seed: int,
) -> DriftReport:
    """Re-render ``k`` sampled messages rows of one run directory; see the module."""
    from service.dataset.manifest import load_records
    from service.dataset.objects import read_states
    from service.masks import conversation_ids

    report = DriftReport()
    problem = template_problem(tokenizer, job)
    if problem is not None:
        report.problems.append(f"{store.url}: {problem}")
    prompts = message_rows(job)
    records = await load_records(store)
    for record in pick(records, prompts, k, seed):
        _, tokens, _unreadable = await read_states(client, job, record)
        if tokens is None:
            continue  # verify's own checks report an unreadable object
        prompt = prompts[record.row]
        rendered = conversation_ids(tokenizer, prompt["messages"], prompt.get("tools"))
        report.checked += 1
        found = differs(tokens, rendered, job.fingerprint.include_output_tokens)
        if found is not None:
            report.problems.append(f"row {record.row} ({record.key}): {found}")
    return report
