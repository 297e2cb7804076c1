"""The conversations a ``--regenerate`` run wrote (``regenerated.jsonl`` beside the
manifest), and whether they render back to the ids stored.

Each line is one ``ok`` row: ``row``, ``custom_id``, ``key`` (its object), ``messages``
(the conversation with the target's answers as text), ``token_ids`` (exactly the
object's: generated ids as generated), ``turns`` (each answer's message index,
``[start, end)`` supervised span, generated tokens, finish reason), ``seed``,
``settings`` and ``input`` (the SHA-256 of the row's conversation as given). A row
decided again (a resume that found its object) may have two lines: the last wins.

Rendering the text back through the chat template need not give the stored ids: the
template re-tokenises the answer's text, which can merge or split tokens the model
produced apart. :func:`render_drift` lists the rows where it does, as ``verify``'s
drift check lists rows whose render changed; :func:`drift_check` is that check for a
regenerated run (its input's answers are not the ones stored, so the input's render
is not what the states are of).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from service.dataset.drift import DriftReport, first_difference, pick, template_problem
from service.dataset.manifest import REGENERATED, Job, load_records
from service.dataset.store import RunStore
from service.masks import conversation_ids

if TYPE_CHECKING:
    from service.client import AsyncHsxClient


async def load_regenerated(store: RunStore) -> dict[int, dict[str, Any]]:
    """Each row's last ``regenerated.jsonl`` line (a torn last line is skipped)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in await store.lines(REGENERATED):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("row"), int):
            rows[record["row"]] = record
    return rows


def render_drift(tokenizer: Any, rows: dict[int, dict[str, Any]]) -> list[str]:
    """One line per row whose conversation, rendered with ``tokenizer``'s chat template,
    does not give its stored ``token_ids``: where they part and how long each is."""
    problems = []
    for row, record in sorted(rows.items()):
        parting = render_parting(tokenizer, record)
        if parting is not None:
            problems.append(f"row {row} ({record.get('custom_id')}): {parting}")
    return problems


def render_parting(tokenizer: Any, record: dict[str, Any]) -> str | None:
    """Where a ``regenerated.jsonl`` record's render leaves its ``token_ids`` (None:
    it gives them exactly)."""
    stored = list(record["token_ids"])
    rendered = conversation_ids(tokenizer, record["messages"])
    if rendered == stored:
        return None
    at = first_difference(stored, rendered)
    return (
        f"the render differs from the stored ids at token {at} ({len(stored)} stored, "
        f"{len(rendered)} rendered)"
    )


async def drift_check(
    client: AsyncHsxClient, store: RunStore, job: Job, tokenizer: Any, k: int, seed: int
) -> DriftReport:
    """Token drift of a regenerated run directory: ``k`` sampled ``ok`` rows (drawn by
    ``seed``), each object's stored ids against its regenerated conversation rendered
    with ``tokenizer`` (:func:`render_parting`), and the template against ``job.json``'s.
    A row the run wrote no conversation for is a problem of its own."""
    from service.dataset.objects import read_states

    report = DriftReport()
    problem = template_problem(tokenizer, job)
    if problem is not None:
        report.problems.append(f"{store.url}: {problem}")
    records = await load_records(store)
    written = await load_regenerated(store)
    every = {row: None for row, r in records.items() if r.status == "ok"}
    for record in pick(records, every, k, seed):
        line = written.get(record.row)
        if line is None:
            report.problems.append(
                f"row {record.row} ({record.key}): token drift: no {REGENERATED}.jsonl line"
            )
            continue
        _, tokens, _unreadable = await read_states(client, job, record)
        if tokens is None:
            continue  # verify's own checks report an unreadable object
        report.checked += 1
        # The object's ids (what its states are of), not the line's copy of them.
        parting = render_parting(tokenizer, {**line, "token_ids": tokens})
        if parting is not None:
            report.problems.append(f"row {record.row} ({record.key}): token drift: {parting}")
    return report
