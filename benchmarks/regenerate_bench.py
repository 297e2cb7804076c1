"""On-policy data in one pass against the two-pass pipeline users run today.

``python -m benchmarks.run --only regenerate_bench`` rewrites these rows of
``docs/benchmarks.md`` (``--quick``: prints them). One hsx server on the demo model
(SmolLM2-135M-Instruct, float32), the same multi-turn conversations for both arms:

- **one pass**: ``hsx dataset run --regenerate``: every assistant turn replaced by the
  target's greedy answer, turn by turn, and the conversation's states stored as
  generated (one object per conversation);
- **two passes**: speculators 0.9's own ``regenerate-responses`` against hsx's
  ``/v1/chat/completions`` (one row per generated answer: its prompt and answer as
  token ids), ``prepare-data`` on those rows, then ``generate-offline-data`` against
  hsx's ``/v1/completions`` (one extraction per row).

The arms alternate (ABBA), the prefix cache emptied before each, so a noisy machine
slows both alike and neither finds the other's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Row, Timer, child_output, serve

QUESTIONS = Path(__file__).resolve().parent / "drafter" / "questions.txt"
ROW_PREFIXES = ("regeneration, one pass",)
#: vLLM's prefix-cache block on this CPU build is 128 tokens, so a turn's last partial
#: block (up to 127 tokens) is computed again by the next request; 32 (the smallest
#: that starts on CPU) keeps that small, for both arms alike.
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
#: Conversations in flight in both arms (speculators' ``--concurrency``; hsx's
#: ``--concurrency`` x ``--batch-size``).
IN_FLIGHT = 16


@dataclasses.dataclass(frozen=True)
class Size:
    """How much work one run does."""

    conversations: int
    turns: int  # user turns per conversation, each answered
    #: Tokens a turn may generate: hsx's ``--regenerate-max-tokens``; speculators'
    #: requests' ``max_completion_tokens`` (its ``--max-tokens`` is also the length at
    #: which it stops a conversation, so that one is the model's length).
    max_tokens: int
    order: str  # the arms' order: "1" one pass, "2" two passes


FULL = Size(conversations=24, turns=3, max_tokens=128, order="1221")
QUICK = Size(conversations=3, turns=2, max_tokens=16, order="12")

NOTES = f"""- **regeneration, one pass vs two passes** (SmolLM2-135M-Instruct, float32, one
  hsx server for both arms, prefix caching on with `block_size` {BLOCK_SIZE}: vLLM's CPU
  default of 128 recomputes up to 127 tokens of every turn's last block, in both arms):
  {FULL.conversations} conversations of {FULL.turns} user turns each
  (`benchmarks/drafter/questions.txt`, consecutive questions, each followed by a
  placeholder answer to be replaced), every answer the target's greedy one, at most
  {FULL.max_tokens} tokens (speculators: `max_completion_tokens` in
  `--sampling-params`, `--max-tokens` {MAX_MODEL_LEN}, since that flag is also where it
  cuts a conversation). One pass:
  `hsx dataset run --regenerate` (`--concurrency 2 --batch-size 8`). Two passes, as
  speculators 0.9 documents them: its own `regenerate-responses` against hsx's
  `/v1/chat/completions` (`--concurrency {IN_FLIGHT}`; it writes one row per answer,
  the conversation up to it), `prepare-data` on those rows, `generate-offline-data`
  against hsx's `/v1/completions` (`--concurrency {IN_FLIGHT}`). hsx's chat route
  stores its prompt's states as every hsx route does (a plain vLLM server would not):
  that write is in the two-pass time. Wall time is each arm end to end, its CLI
  starts included; the arms alternate (ABBA), the prefix cache emptied before each,
  on a shared 2-core machine where other work runs too (noisy: the ratio is what
  counts). Forward tokens per conversation: one pass, the manifest's
  `forward_tokens` (each turn's uncached prompt tokens and decode steps, then the
  storing request's uncached tokens); two passes, from vLLM's own counters over the
  arm (prompt tokens less prefix-cache hits, plus decode steps: generated tokens less
  one per request), the chat calls' and the extraction's together; vLLM's counters
  for the one-pass arm are in the row too. Both arms ran the same answers when their
  generated token counts agree (the row gives both). `--quick` ({QUICK.conversations}
  conversations of {QUICK.turns} turns) shows the pipeline, not the gap.
"""


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """One row: both arms' wall time and forward tokens per conversation."""
    del timer  # the arms are whole pipelines, timed here in ABBA order
    size = QUICK if quick else FULL
    work = scratch / "regenerate"
    work.mkdir(parents=True, exist_ok=True)
    model = await asyncio.to_thread(_demo_model)
    questions = [q for q in QUESTIONS.read_text().splitlines() if q.strip()]
    found: dict[str, list[dict[str, float]]] = {"1": [], "2": []}
    async with hsx_server(model, work, eager=quick) as (url, extractor):
        for round_, arm in enumerate(size.order):
            rows = conversations(questions, size, f"r{round_}")
            place = work / f"round-{round_}-{arm}"
            place.mkdir()
            await extractor.engine.reset_prefix_cache()
            before = vllm_counters()
            start = time.perf_counter()
            if arm == "1":
                measured = await one_pass(url, rows, size, place)
            else:
                measured = await two_passes(url, model, rows, size, place)
            measured["seconds"] = time.perf_counter() - start
            measured["vllm_forward"] = forward_of(before, vllm_counters())
            found[arm].append(measured)
    return [row(found, size)]


def _demo_model() -> Path:
    from service.demo_model import DEMO_DIR, prepare

    return prepare(REPO / DEMO_DIR)


def conversations(questions: list[str], size: Size, tag: str) -> list[dict[str, Any]]:
    """``size.conversations`` conversations of ``size.turns`` consecutive questions, each
    with a placeholder answer (both arms replace it); ids unique to ``tag`` (a round), so
    a round finds no object another one stored."""
    rows = []
    for c in range(size.conversations):
        messages: list[dict[str, str]] = []
        for t in range(size.turns):
            question = questions[(c * size.turns + t) % len(questions)]
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "I do not know."},
            ]
        rows.append({"custom_id": f"{tag}-{c:04d}", "id": f"{tag}-{c:04d}", "messages": messages})
    return rows


@contextlib.asynccontextmanager
async def hsx_server(model: Path, work: Path, eager: bool) -> AsyncIterator[tuple[str, Any]]:
    """An open hsx (no keys) on ``model`` in float32, objects under ``work``; yields its
    URL and its extractor (whose engine's prefix cache each round empties)."""
    from service.config import Settings
    from service.engine.extractor import Extractor

    extra: dict[str, Any] = {"block_size": BLOCK_SIZE}
    if eager:  # a quick run would spend most of its time compiling
        extra["enforce_eager"] = True
    settings = Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN,
            "cpu_kvcache_space_gib": 1,
            "extra_args": extra,
        },
        storage={"url": str(work / "objects")},
        limits={"max_prompts": 64, "max_queued_prompts": 4096, "max_tokens": MAX_MODEL_LEN},
    )
    extractor = await Extractor.start(settings)
    try:
        server, task, url = await serve(settings, extractor)
        try:
            yield url, extractor
        finally:
            server.should_exit = True
            await task
    finally:
        await extractor.close()


async def one_pass(
    url: str, rows: list[dict[str, Any]], size: Size, work: Path
) -> dict[str, float]:
    """``hsx dataset run --regenerate``; the manifest's counts."""
    source = work / "conversations.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = work / "run"
    await command(
        [sys.executable, "-m", "service", "dataset", "run", str(source), "--endpoint", url,
         "--output", str(output), "--regenerate", "--regenerate-max-tokens",
         str(size.max_tokens), "--concurrency", "2", "--batch-size", str(IN_FLIGHT // 2),
         "--no-progress"],
        log=work / "dataset-run.log",
    )  # fmt: skip
    summary = json.loads((output / "summary.json").read_text())
    assert summary["ok"] == len(rows), summary
    records = [json.loads(line) for line in (output / "manifest.jsonl").read_text().splitlines()]
    lines = [json.loads(line) for line in (output / "regenerated.jsonl").read_text().splitlines()]
    return {
        "forward": sum(r["forward_tokens"] for r in records),
        "recomputed": sum(r["recomputed_tokens"] for r in records),
        "tokens": sum(r["num_tokens"] for r in records),
        "generated": sum(t["generated"] for line in lines for t in line["turns"]),
        "conversations": len(records),
        "answers": sum(len(line["turns"]) for line in lines),
        "capped": sum(t["finish_reason"] == "length" for line in lines for t in line["turns"]),
    }


async def two_passes(
    url: str, model: Path, rows: list[dict[str, Any]], size: Size, work: Path
) -> dict[str, float]:
    """speculators' ``regenerate-responses``, ``prepare-data``, ``generate-offline-data``
    against hsx, as its users run them; the rows' counts."""
    source = work / "conversations.jsonl"
    source.write_text(
        "".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in rows)
    )
    regenerated, prepared = work / "regenerated.jsonl", work / "prepared"
    script = str(Path(sys.executable).with_name("speculators"))
    # --model is the served name the chat route checks, and the tokenizer speculators
    # loads for its review text: the model's directory, seen from its parent.
    await command(
        [script, "regenerate-responses", "--endpoint", f"{url}/v1/chat/completions",
         "--model", model.name, "--dataset", str(source), "--outfile", str(regenerated),
         "--max-tokens", str(MAX_MODEL_LEN), "--concurrency", str(IN_FLIGHT),
         "--sampling-params",
         json.dumps({"temperature": 0, "max_completion_tokens": size.max_tokens})],
        log=work / "regenerate-responses.log", cwd=model.parent,
    )  # fmt: skip
    samples = [json.loads(line) for line in regenerated.read_text().splitlines()]
    await command(
        [script, "prepare-data", "--model", str(model), "--data", str(regenerated),
         "--output", str(prepared), "--seq-length", str(MAX_MODEL_LEN),
         "--num-preprocessing-workers", "1"],
        log=work / "prepare-data.log",
    )  # fmt: skip
    await command(
        [script, "generate-offline-data", "--endpoint", f"{url}/v1",
         "--preprocessed-data", str(prepared), "--concurrency", str(IN_FLIGHT),
         "--fail-on-error"],
        log=work / "generate-offline-data.log",
    )  # fmt: skip
    written = list((prepared / "hidden_states").glob("hs_*.safetensors"))
    assert len(written) == len(samples), (len(written), len(samples))
    conversations = {s["primary_id"] for s in samples}
    return {
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "generated": sum(sum(s["loss_mask"]) for s in samples),
        "conversations": len(conversations),
        "answers": len(samples),
        "capped": sum(1 for s in samples if s["metadata"].get("finish_reason") == "length"),
    }


def vllm_counters() -> dict[str, float]:
    """vLLM's own counters in this process (its Prometheus logger): prompt tokens,
    prefix-cache hits, generated tokens, finished requests."""
    from prometheus_client import REGISTRY

    wanted = {
        "vllm:prompt_tokens_total": "prompt",
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:generation_tokens_total": "generated",
        "vllm:request_success_total": "requests",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return totals


def forward_of(before: dict[str, float], after: dict[str, float]) -> float:
    """Tokens the target ran forward between two readings: prompt tokens not found in
    the prefix cache, and each generated token but a request's last fed back."""
    delta = {name: after[name] - before[name] for name in before}
    return delta["prompt"] - delta["hits"] + delta["generated"] - delta["requests"]


def row(found: dict[str, list[dict[str, float]]], size: Size) -> Row:
    """Both arms' median wall time and forward tokens per conversation."""
    one, two = found["1"], found["2"]
    seconds = {arm: sorted(m["seconds"] for m in found[arm]) for arm in found}
    mid = {arm: values[len(values) // 2] if len(values) % 2 else sum(values) / 2
           for arm, values in seconds.items()}  # fmt: skip
    count = one[0]["conversations"]
    forward_one = one[0]["forward"] / count
    vllm_one = one[0]["vllm_forward"] / count
    forward_two = two[0]["vllm_forward"] / max(1, two[0]["conversations"])
    times = lambda arm: " / ".join(f"{s:.0f}" for s in seconds[arm])  # noqa: E731
    return Row(
        f"regeneration, one pass (`hsx dataset run --regenerate`) vs two passes (speculators "
        f"`regenerate-responses`, `prepare-data`, `generate-offline-data`, against the same "
        f"hsx), SmolLM2, {count} conversations of {size.turns} turns, greedy; wall s per "
        f"round ({times('1')} vs {times('2')}); target forward tokens per conversation: "
        f"{forward_one:.0f} (vLLM's count {vllm_one:.0f}, {one[0]['recomputed']:.0f} "
        f"recomputed in all) vs {forward_two:.0f}; stored tokens {one[0]['tokens']:.0f} vs "
        f"{two[0]['tokens']:.0f}, generated {one[0]['generated']:.0f} vs "
        f"{two[0]['generated']:.0f} ({one[0]['answers']:.0f} vs {two[0]['answers']:.0f} "
        f"answers, {one[0]['capped']:.0f} vs {two[0]['capped']:.0f} at the {size.max_tokens}"
        "-token cap)",
        f"{mid['1']:.1f} s, {forward_one:.0f} fwd tok/conv",
        f"{mid['2']:.1f} s, {forward_two:.0f} fwd tok/conv",
        mid["1"] / mid["2"],
        "<= 0.83 (1.2x faster)",
    )


def child_env() -> dict[str, str]:
    """The environment of every command: the caller's, less the bench's switches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_BENCH_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


async def command(argv: list[str], log: Path, cwd: Path = REPO) -> str:
    """Run ``argv``, its output going to ``log`` as it comes; the output. A failure
    raises with the output's tail."""
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=child_env(), stdout=sink, stderr=asyncio.subprocess.STDOUT
        )
        status = await proc.wait()
    return await child_output(" ".join(argv[:3]), status, log)
