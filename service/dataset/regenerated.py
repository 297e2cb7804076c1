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
drift check lists rows whose render changed.
"""

from __future__ import annotations

import json
from typing import Any

from service.dataset.manifest import REGENERATED
from service.dataset.store import RunStore
from service.masks import conversation_ids


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
        stored = list(record["token_ids"])
        rendered = conversation_ids(tokenizer, record["messages"])
        if rendered == stored:
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(stored, rendered, strict=False)) if a != b),
            min(len(stored), len(rendered)),
        )
        problems.append(
            f"row {row} ({record.get('custom_id')}): the render differs from the stored "
            f"ids at token {at} ({len(stored)} stored, {len(rendered)} rendered)"
        )
    return problems
