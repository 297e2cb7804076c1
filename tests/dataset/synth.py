"""A synthetic conversation dataset with known good, over-long and malformed rows."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXT = (
    "the model reads hidden states from every layer and writes them to storage while "
    "a drafter learns to guess the next token quickly on a small budget"
)
WORDS = TEXT.split()


@dataclass
class Synthetic:
    """The rows, and which of them are meant to be refused."""

    rows: list[Any] = field(default_factory=list)
    long: set[int] = field(default_factory=set)
    malformed: set[int] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    @property
    def valid(self) -> set[int]:
        return set(range(len(self.lines))) - self.long - self.malformed

    def write_jsonl(self, path: Path) -> Path:
        path.write_text("".join(line + "\n" for line in self.lines))
        return path


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random, turns: int, words: tuple[int, int]) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _sentence(rng, 2, 5)})
    for _ in range(turns):
        messages.append({"role": "user", "content": _sentence(rng, *words)})
        messages.append({"role": "assistant", "content": _sentence(rng, *words)})
    return messages


def sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


MALFORMED = [
    '{"conversations": [{"from": "human"',  # not JSON (torn line)
    json.dumps({"messages": []}),  # no turns
    json.dumps({"title": "no prompt column here"}),
    json.dumps({"messages": [{"content": "who am I"}]}),  # a turn without a role
    json.dumps({"conversations": "not a list"}),
    json.dumps(["a", "list", "not", "an", "object"]),
]


def make(count: int, seed: int = 0, long_every: int = 40, malformed_every: int = 300) -> Synthetic:
    """``count`` rows: multi-turn chats (OpenAI and ShareGPT shapes), every
    ``long_every``-th one far over 256 tokens, every ``malformed_every``-th malformed."""
    rng = random.Random(seed)
    out = Synthetic()
    for index in range(count):
        if index % malformed_every == malformed_every - 1:
            out.malformed.add(index)
            out.lines.append(MALFORMED[(index // malformed_every) % len(MALFORMED)])
            out.rows.append(None)
            continue
        if index % long_every == long_every - 1:
            out.long.add(index)
            messages = conversation(rng, 3, (120, 160))
        else:
            messages = conversation(rng, rng.randint(1, 3), (2, 8))
        row: dict[str, Any] = (
            {"messages": messages} if index % 2 else {"conversations": sharegpt(messages)}
        )
        # Distinct content: two equal rows would share one id (and one object).
        row["source"] = f"synthetic-{seed}-{index}"
        out.rows.append(row)
        out.lines.append(json.dumps(row))
    return out
