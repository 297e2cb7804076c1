"""``verify --token-drift`` on a ``--regenerate`` run: each object's ids are checked
against the conversation the run wrote (``regenerated.jsonl``), not against its input,
whose assistant answers are the ones that were replaced.

No engine: a run directory on disk as ``hsx dataset run --regenerate`` writes it, its
objects served over real HTTP by a stand-in (``tests/dataset/standins.py``), and the
demo model's real tokenizer and chat template.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.dataset.manifest import Fingerprint, Job
from service.dataset.verify import Checks, verify_async
from service.masks import conversation_ids
from tests.dataset.standins import Reply, Scripted

LAYERS, HIDDEN = [1, 2], 4
QUESTIONS = ["What is the capital of France?", "Name a mammal.", "Add 2 and 3."]
#: The answers in the input: replaced by the run, so never what its objects hold.
GIVEN = ["Lyon.", "A trout.", "6."]
#: The target's answers, as the run wrote them.
ANSWERS = ["Paris is the capital of France.", "The dog is a mammal.", "2 and 3 make 5."]


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def user(question: str) -> dict[str, str]:
    return {"role": "user", "content": question}


def assistant(answer: str) -> dict[str, str]:
    return {"role": "assistant", "content": answer}


def split_answer(tokenizer: Any, ids: list[int], answer: str) -> list[int]:
    """``ids`` with the answer's first word generated letter by letter: the same text,
    ids the template's render of it does not give (the drift a model can produce)."""
    word = answer.split()[0]
    whole, letters = tokenizer.encode(word), [tokenizer.encode(c)[0] for c in word]
    assert whole != letters
    at = next(i for i in range(len(ids)) if ids[i : i + len(whole)] == whole)
    return ids[:at] + letters + ids[at + len(whole) :]


def stored_object(ids: list[int], supervised: int) -> bytes:
    import torch
    from safetensors.torch import save

    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[-supervised:] = 1
    return save(
        {
            "hidden_states": torch.randn(len(ids), len(LAYERS), HIDDEN),
            "token_ids": torch.tensor(ids, dtype=torch.int64),
            "loss_mask": mask,
        }
    )


def write_run(out: Path, tokenizer: Any, drifted: int, served: Scripted) -> list[list[int]]:
    """A regenerated run of the three questions under ``out``; row ``drifted``'s answer
    was generated in other tokens than its render's. Each row's stored ids."""
    out.mkdir()
    source = out.parent / "input.jsonl"
    source.write_text(
        "".join(
            json.dumps({"custom_id": f"q{i}", "messages": [user(q), assistant(a)]}) + "\n"
            for i, (q, a) in enumerate(zip(QUESTIONS, GIVEN, strict=True))
        )
    )
    template = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    fingerprint = Fingerprint(
        model="demo", layer_ids=LAYERS, hidden_size=HIDDEN, dtype="float32", codec="raw",
        chat_template_sha256=template, loss="assistant", max_length=1024, on_long="skip",
        max_tokens=1, include_output_tokens=False, hsx_version="test",
        regenerate={"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "seed": 0},
    )  # fmt: skip
    job = Job(fingerprint=fingerprint, input=str(source), input_rows=len(QUESTIONS))
    (out / "job.json").write_text(job.model_dump_json())
    manifest, lines, stored = [], [], []
    for i, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS, strict=True)):
        messages = [user(question), assistant(answer)]
        ids = conversation_ids(tokenizer, messages)
        if i == drifted:
            ids = split_answer(tokenizer, ids, answer)
        stored.append(ids)
        key = f"hsx/default/by-id/q{i}.safetensors"
        data = stored_object(ids, supervised=4)
        served.objects[key] = data
        manifest.append(
            {"row": i, "custom_id": f"q{i}", "status": "ok", "key": key,
             "num_tokens": len(ids), "num_loss_tokens": 4, "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest(), "forward_tokens": len(ids)}
        )  # fmt: skip
        lines.append(
            {"row": i, "custom_id": f"q{i}", "key": key, "messages": messages, "token_ids": ids}
        )
    (out / "manifest.jsonl").write_text("".join(json.dumps(m) + "\n" for m in manifest))
    (out / "regenerated.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return stored


def test_drift_reads_the_regenerated_conversations_not_the_input(
    tmp_path: Path,
    tokenizer: Any,
    demo_model: Path,
    servers: Callable[[Callable[[dict[str, Any]], Reply]], Scripted],
) -> None:
    served = servers(lambda body: (404, {}, {}))
    out = tmp_path / "run"
    ids = write_run(out, tokenizer, drifted=1, served=served)
    rendered = conversation_ids(tokenizer, [user(QUESTIONS[1]), assistant(ANSWERS[1])])
    parts = next(i for i, (a, b) in enumerate(zip(ids[1], rendered, strict=False)) if a != b)
    checks = Checks(drift=10, parity_model=str(demo_model))

    report = asyncio.run(verify_async(str(out), served.url, checks=checks))

    # Every row's input answer differs from its stored one; only the row whose ids the
    # render of its written conversation does not give is listed.
    assert report.checked == 3
    assert report.drift_checked == 3
    assert report.problems == [
        f"row 1 (hsx/default/by-id/q1.safetensors): token drift: the render differs from "
        f"the stored ids at token {parts} ({len(ids[1])} stored, {len(rendered)} rendered)"
    ]
    assert len(ids[1]) > len(rendered)  # the answer's first word, letter by letter


def test_a_row_without_its_conversation_is_listed(
    tmp_path: Path,
    tokenizer: Any,
    demo_model: Path,
    servers: Callable[[Callable[[dict[str, Any]], Reply]], Scripted],
) -> None:
    served = servers(lambda body: (404, {}, {}))
    out = tmp_path / "run"
    write_run(out, tokenizer, drifted=-1, served=served)
    lines = (out / "regenerated.jsonl").read_text().splitlines()
    (out / "regenerated.jsonl").write_text("\n".join(lines[:2]) + "\n")  # row 2's lost

    report = asyncio.run(
        verify_async(str(out), served.url, checks=Checks(drift=10, parity_model=str(demo_model)))
    )

    assert report.drift_checked == 2
    assert report.problems == [
        "row 2 (hsx/default/by-id/q2.safetensors): token drift: no regenerated.jsonl line"
    ]
