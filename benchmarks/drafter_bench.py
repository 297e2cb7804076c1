"""The drafter proof (issue 25): EAGLE-3 drafters trained on hsx's states are as good as
drafters trained on a transformers reference, and a corrupted control is clearly worse.

``python -m benchmarks.run --only drafter_bench`` rewrites just these rows of
``docs/benchmarks.md`` (``--quick``: prints them). Every step is real and runs on this
CPU:

1. an hsx server on the demo model (SmolLM2-135M-Instruct, float32, layers
   [2, 15, 27, 30]) answers each seed question of ``benchmarks/drafter/questions.txt``
   and stores the conversation's states in one pass, ``hsx dataset run --regenerate``
   (greedy, the ``raw`` codec): the conversations are the target's own, their ids as
   generated;
2. ``hsx dataset run`` stores the same ids' states again with the ``fp8`` codec, and
   ``hsx dataset export --format speculators`` writes each run as speculators' data
   directory, both with the regenerated run's ids and masks: arms (a) and (b);
3. ``benchmarks.drafter.reference`` recomputes every sample's states with transformers
   in float32 (arm (c)) and writes an all-zero copy (arm (d), vLLM #46301's failure);
4. ``speculators train`` (its own code, through ``benchmarks.drafter.train_cpu``'s three
   CPU patches) trains one EAGLE-3 drafter per arm, same seed and schedule;
5. ``benchmarks.drafter.evaluate`` scores each drafter on the held-out conversations,
   on the reference states, against the target's greedy next token;
6. ``benchmarks.drafter.vllm_accept`` runs each drafter in vLLM's EAGLE-3 speculative
   decoding on the held-out questions and reads vLLM's mean acceptance length.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Preforked,
    Row,
    Timer,
    child_output,
    last_json,
    serve,
)

QUESTIONS = Path(__file__).resolve().parent / "drafter" / "questions.txt"
#: Every HOLDOUT_EVERY-th question is held out: scored, never trained on.
HOLDOUT_EVERY = 8
SEED = 0
DRAFT_VOCAB = 8192
SEQ_LEN = 512
#: The aux layers the drafter reads; hsx serves them plus the last layer (30), which
#: speculators takes as the verifier's final states (the loss targets).
TARGET_LAYERS = (2, 15, 27)
ARMS = {
    "a": "(a) hsx raw",
    "b": "(b) hsx fp8",
    "c": "(c) transformers reference",
    "d": "(d) all-zero states (control)",
}
ROW_PREFIXES = ("drafter ",)
#: What the reference forward, the training runs and the scoring import: each of them
#: is a child forked from one process that imported these (``Preforked``).
TORCH_STAGES = (
    "torch",
    "safetensors.torch",
    "transformers",
    "datasets",
    "speculators.cli",
    "speculators.train.trainer",
    "speculators.train.checkpointer",
    "speculators.train.data",
    "speculators.models.eagle3",
)


@dataclasses.dataclass(frozen=True)
class Size:
    """How much work one run does."""

    questions: int  # seed questions used (the first N of the file)
    max_tokens: int  # longest greedy response
    epochs: int


FULL = Size(questions=402, max_tokens=128, epochs=3)
#: Shows the pipeline end to end, not the gap: too few rows and one epoch (24
#: questions: 3 held out, the fewest that still give every row something to score).
QUICK = Size(questions=24, max_tokens=24, epochs=1)

_HELD = FULL.questions // HOLDOUT_EVERY
NOTES = f"""- **drafter proof (issue 25), data**: {FULL.questions} seed questions
  (`benchmarks/drafter/questions.txt`, written from templates: capitals, animals,
  science, how-tos, poems, code, arithmetic, translations), each answered by the demo
  model itself (SmolLM2-135M-Instruct, float32), greedy, at most {FULL.max_tokens}
  tokens (speculators' advice: regenerate the responses with the target), in one pass:
  `hsx dataset run --regenerate` generates each answer and stores the conversation's
  states (codec `raw`), its ids as generated and its loss mask over the generated
  tokens and the end-of-turn tokens. Every {HOLDOUT_EVERY}th conversation is held out
  ({_HELD}), the other {FULL.questions - _HELD} train. `hsx dataset export --format
  speculators` makes arm (a); arm (b) is `hsx dataset run` on the same ids with codec
  `fp8`, exported with (a)'s ids, masks and `token_freq.pt`; arm (c) is the same
  samples' states from a transformers float32 forward
  (`benchmarks/drafter/reference.py`), arm (d) the same files with every state zero,
  as vLLM #46301 returned them. Ids, masks and `token_freq.pt` are the same in all
  four, so the arms differ only in their hidden states.
- **drafter training**: `speculators train` 0.9.0 itself, once per arm, one after
  the other: EAGLE-3, one draft layer, draft vocabulary {DRAFT_VOCAB} (built from
  `token_freq.pt`, so the same in every arm), aux layers {list(TARGET_LAYERS)} plus
  layer 30 as the verifier's states, `--total-seq-len {SEQ_LEN} --epochs {FULL.epochs}
  --seed {SEED}`, its default schedule (Muon on 2-D weights plus AdamW, lr 1e-3, 1%
  warmup then linear decay, 3 TTT steps, KL loss), float32; the held-out rows are its
  validation split, never trained on. On this CPU it runs through
  `benchmarks/drafter/train_cpu.py`, which patches three helpers that assume a CUDA
  device (the batch's `.to(local_rank)` target, the step timer's
  `torch.accelerator.synchronize`, the resume device) and then calls speculators' own
  CLI, with `--draft-attn-impl sdpa` (flex attention needs a compiler backend),
  `--loss-implementation eager` and `--num-workers 0`. Random: the drafter's initial
  weights and the packing order (seed {SEED} in every arm); real: the model, its
  answers, their states, speculators' trainer. Each arm trains in a process of its
  own, forked, as are the reference forward and the scoring, from one process that
  imported torch, transformers and speculators once (`benchmarks/preforked.py`:
  8 CPU-seconds saved per stage); a forked process's peak RSS leaves out the library
  pages a fresh interpreter maps and never touches (quick size: 1092 MiB forked, 1233
  MiB fresh).
- **drafter top-1 agreement**: every drafter reads the held-out samples' reference
  states (what the target hands its drafter at inference) through speculators'
  `ArrowDataset` and `shift_batch` and runs its own 3-step test-time rollout
  (`benchmarks/drafter/evaluate.py`). Its token, mapped through `d2t`, is compared
  with the target's greedy next token from the transformers forward (argmax over the
  full 49152-token vocabulary, so a token outside the draft vocabulary is a miss)
  wherever the loss mask is set. At steps 1 and 2 the drafter feeds on its own states
  of the step before and on the true tokens (teacher-forced, as in speculators'
  training and validation); each step is counted over all masked positions, not only
  where the earlier steps were right. Targets: (a) and (b) within 0.02 of (c); (d) at
  least 0.1 below (c).
- **drafter acceptance length**: each checkpoint, as `speculators train` saved it, is
  the drafter of vLLM's own EAGLE-3 speculative decoding on the CPU build
  (`benchmarks/drafter/vllm_accept.py`: target in float32, 3 draft tokens, greedy,
  eager mode, one engine per drafter, one after the other in one process) over the
  held-out questions; the row is vLLM's mean acceptance length, 1 + accepted draft
  tokens / drafts, from its `spec_decode` counters. The teacher-forced row is the same
  quantity estimated from the rollout the top-1 rows score (per held-out position:
  leading correct steps of 3, plus the bonus token). `--quick` ({QUICK.questions}
  questions, {QUICK.max_tokens} tokens, {QUICK.epochs} epoch) shows the pipeline, not
  the gap.
"""


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """The drafter rows: held-out top-1 agreement of arms (a)-(d), acceptance lengths
    (teacher-forced estimate and vLLM's), and what the run cost."""
    del timer  # nothing here is a timed pair; wall times are reported as information
    size = QUICK if quick else FULL
    work = scratch / "drafter"
    work.mkdir(parents=True, exist_ok=True)
    model = await asyncio.to_thread(_demo_model)
    clock: dict[str, float] = {}
    train_q, held_q = split(load_questions(size.questions))
    # The torch stages' process imports while the hsx server starts and answers.
    async with Preforked.start(TORCH_STAGES, work / "stages.log", child_env()) as stages:
        async with _timed(clock, "hsx"), hsx_server(model, work, eager=quick) as url:
            exports = await regenerate_and_export(url, train_q + held_q, size.max_tokens, work)
        async with _timed(clock, "reference"):
            errors = await reference_arms(stages, model, exports, work, holdout=len(train_q))
        data = {
            "a": exports["raw"],
            "b": exports["fp8"],
            "c": work / "reference",
            "d": work / "control",
        }
        checkpoints, peaks = {}, []
        for arm, path in data.items():
            async with _timed(clock, f"train {arm}"):
                save = work / f"drafter-{arm}"
                checkpoints[arm], peak = await train(stages, model, path, save, size)
            peaks.append(peak)
        async with _timed(clock, "score"):
            scores = await evaluate(stages, data["c"], len(train_q), checkpoints)
    async with _timed(clock, "vLLM"):
        accepted = await vllm_acceptance(model, checkpoints, held_q, size.max_tokens, work)
    found = rows(scores, errors, clock, peaks, len(train_q), len(held_q), size)
    found.insert(len(ARMS) + 1, acceptance_row(accepted, len(held_q)))
    return found


def _demo_model() -> Path:
    from service.demo_model import DEMO_DIR, prepare

    return prepare(REPO / DEMO_DIR)


@contextlib.asynccontextmanager
async def _timed(clock: dict[str, float], name: str) -> AsyncIterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        clock[name] = time.perf_counter() - start


def load_questions(count: int) -> list[str]:
    """The first ``count`` seed questions (the file is in a fixed shuffled order)."""
    questions = [q for q in QUESTIONS.read_text().splitlines() if q.strip()]
    return questions[:count]


def split(questions: list[str]) -> tuple[list[str], list[str]]:
    """(training questions, held-out questions): every HOLDOUT_EVERY-th is held out."""
    held = [q for i, q in enumerate(questions) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [q for i, q in enumerate(questions) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    return train, held


@contextlib.asynccontextmanager
async def hsx_server(model: Path, work: Path, eager: bool = False) -> AsyncIterator[str]:
    """An open hsx (no keys) on ``model`` in float32 with the default EAGLE-3 layers,
    objects under ``work``; yields its URL. ``eager``: no graph compilation at start-up
    (as ``hsx serve`` runs; a quick run would spend most of its time compiling)."""
    from service.config import Settings
    from service.engine.extractor import Extractor

    settings = Settings(
        engine={
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 1024,
            "cpu_kvcache_space_gib": 1,
            **({"extra_args": {"enforce_eager": True}} if eager else {}),
        },
        storage={"url": str(work / "objects")},
        limits={"max_prompts": 64, "max_queued_prompts": 4096},
    )
    extractor = await Extractor.start(settings)
    try:
        server, task, url = await serve(settings, extractor)
        try:
            yield url
        finally:
            server.should_exit = True
            await task
    finally:
        await extractor.close()


async def regenerate_and_export(
    url: str, questions: list[str], max_tokens: int, work: Path
) -> dict[str, Path]:
    """Arms (a) and (b) (:func:`regenerate` and :func:`fp8_arm`): the exported
    directories by codec."""
    raw, lines = await regenerate(url, questions, max_tokens, work)
    return {"raw": raw, "fp8": await fp8_arm(url, raw, lines, work)}


async def regenerate(
    url: str, questions: list[str], max_tokens: int, work: Path
) -> tuple[Path, list[dict[str, Any]]]:
    """``hsx dataset run --regenerate``: every question answered greedily and its
    conversation's states stored (``raw``) in one pass, exported ``--format
    speculators``; the exported directory and each row's ``regenerated.jsonl`` line,
    in row order."""
    source = work / "questions.jsonl"
    source.write_text(
        "".join(
            json.dumps({"custom_id": f"q-{i:04d}", "messages": [{"role": "user", "content": q}]})
            + "\n"
            for i, q in enumerate(questions)
        )
    )
    raw = await run_and_export(
        url, source, "raw", work,
        "--regenerate", "--regenerate-max-tokens", str(max_tokens), "--loss", "assistant",
    )  # fmt: skip
    lines = [json.loads(line) for line in (work / "run-raw" / "regenerated.jsonl").open()]
    by_row = {line["row"]: line for line in lines}  # a row's last line wins
    assert sorted(by_row) == list(range(len(questions))), "rows missing from regenerated.jsonl"
    return raw, [by_row[row] for row in sorted(by_row)]


async def fp8_arm(url: str, raw: Path, lines: list[dict[str, Any]], work: Path) -> Path:
    """Arm (b): the regenerated ids as given, stored with ``fp8`` and exported with
    ``raw``'s ids, loss masks and ``token_freq.pt``."""
    # custom_ids of its own: the same id would find the raw run's object.
    ids = work / "conversations-fp8.jsonl"
    ids.write_text(
        "".join(
            json.dumps({"custom_id": f"fp8-{line['row']:04d}", "token_ids": line["token_ids"]})
            + "\n"
            for line in lines
        )
    )
    fp8 = await run_and_export(url, ids, "fp8", work, "--loss", "all")
    await asyncio.to_thread(adopt_layout, raw, fp8)
    return fp8


async def run_and_export(url: str, source: Path, codec: str, work: Path, *flags: str) -> Path:
    """``hsx dataset run`` of ``source`` with ``codec`` and ``flags``, then ``hsx
    dataset export --format speculators``; the exported directory."""
    output, dest = work / f"run-{codec}", work / f"export-{codec}"
    await _child(
        "service", "dataset", "run", str(source), "--endpoint", url, "--output", str(output),
        "--codec", codec, "--concurrency", "4", "--batch-size", "8", "--no-progress", *flags,
        log=work / f"dataset-run-{codec}.log",
    )  # fmt: skip
    summary = json.loads((output / "summary.json").read_text())
    rows = sum(1 for line in source.open() if line.strip())
    assert summary["ok"] == rows, summary
    await _child(
        "service", "dataset", "export", str(output), str(dest), "--format", "speculators",
        "--endpoint", url, log=work / f"dataset-export-{codec}.log",
    )  # fmt: skip
    return dest


def adopt_layout(source: Path, dest: Path) -> None:
    """``dest``'s dataset files (ids, masks, ``token_freq.pt``) replaced by ``source``'s;
    its hidden states kept (the reference checks their ids are ``source``'s)."""
    import shutil

    for item in dest.iterdir():
        if item.is_file():
            item.unlink()
    for item in source.iterdir():
        if item.is_file() and not item.name.startswith(("d2t-", "t2d-")):
            shutil.copy2(item, dest / item.name)


async def reference_arms(
    stages: Preforked, model: Path, exports: dict[str, Path], work: Path, holdout: int
) -> dict[str, list[float]]:
    """Arms (c) and (d) under ``work``; the worst relative error per layer of the raw
    and fp8 states against the reference."""
    out = await stages.run(
        "benchmarks.drafter.reference", str(model), str(exports["raw"]),
        str(work / "reference"), str(work / "control"), str(holdout), str(exports["fp8"]),
        log=work / "reference.log",
    )  # fmt: skip
    errors: dict[str, list[float]] = last_json(out)["worst_relative_error"]
    return errors


def train_args(model: Path, data: Path, save: Path, size: Size, ratio: float) -> list[str]:
    """``speculators train`` flags of every arm: only the data path and output differ."""
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(model),
        "--data-path", str(data),
        "--save-path", str(save),
        "--log-dir", str(save / "logs"),
        "--seed", str(SEED),
        "--epochs", str(size.epochs),
        "--draft-vocab-size", str(DRAFT_VOCAB),
        "--total-seq-len", str(SEQ_LEN),
        "--target-layer-ids", *map(str, TARGET_LAYERS),
        "--train-data-ratio", f"{ratio:.6f}",
        "--hidden-states-dtype", "float32",
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--num-workers", "0",
        "--on-missing", "raise",
        "--log-freq", "10",
    ]  # fmt: skip


async def train(
    stages: Preforked, model: Path, data: Path, save: Path, size: Size
) -> tuple[Path, int]:
    """Train one drafter (a process of its own, forked from ``stages``, so its memory
    is given back); its last checkpoint and the training process's peak RSS in MiB."""
    from datasets import load_from_disk

    total = len(load_from_disk(str(data)))
    held = len(split(load_questions(size.questions))[1])
    ratio = (total - held + 0.5) / total  # speculators splits at int(total * ratio)
    out = await stages.run(
        "benchmarks.drafter.train_cpu", *train_args(model, data, save, size, ratio),
        log=save.with_suffix(".log"),
    )  # fmt: skip
    peak = re.findall(r"hsx-bench peak_rss_mib=(\d+)", out)
    checkpoint = save / str(size.epochs - 1)
    assert (checkpoint / "model.safetensors").is_file(), f"no checkpoint in {save}"
    return checkpoint, int(peak[-1]) if peak else 0


async def evaluate(
    stages: Preforked, reference: Path, holdout: int, checkpoints: dict[str, Path]
) -> dict:
    """Held-out scores of every drafter (``benchmarks.drafter.evaluate``)."""
    out = await stages.run(
        "benchmarks.drafter.evaluate", str(reference), str(holdout),
        *(f"{arm}={path}" for arm, path in checkpoints.items()),
        log=reference.parent / "evaluate.log",
    )  # fmt: skip
    return last_json(out)


async def vllm_acceptance(
    model: Path, checkpoints: dict[str, Path], questions: list[str], max_tokens: int, work: Path
) -> dict[str, dict[str, Any] | str]:
    """Each drafter in vLLM's EAGLE-3 speculative decoding on the held-out questions
    (``benchmarks.drafter.vllm_accept``: one engine per drafter, one after the other in
    one child process): vLLM's counters, or why the run failed."""
    path = work / "held-out-questions.json"
    await asyncio.to_thread(path.write_text, json.dumps(questions))
    arms = [f"{arm}={checkpoint}" for arm, checkpoint in checkpoints.items()]
    try:
        out = await _child(
            "benchmarks.drafter.vllm_accept", str(model), str(path), str(max_tokens), *arms,
            log=work / "vllm-accept.log",
        )  # fmt: skip
    except RuntimeError as error:  # the row says why instead of failing the bench
        return {arm: str(error).splitlines()[-1][:200] for arm in checkpoints}
    found = {line["arm"]: line for line in _json_lines(out) if "arm" in line}
    results: dict[str, dict[str, Any] | str] = {}
    for arm in checkpoints:
        line = found.get(arm, {"error": "no result line"})
        results[arm] = line.get("error", line)
    return results


def acceptance_row(results: dict[str, dict[str, Any] | str], held: int) -> Row:
    """vLLM's mean acceptance length per drafter, (a) / (b) / (d) against (c)."""

    def text(arm: str) -> str:
        found = results[arm]
        if isinstance(found, str) or found.get("acceptance_length") is None:
            return f"not measured ({found})"
        return f"{found['acceptance_length']:.2f}"

    ours, base = " / ".join(text(a) for a in "abd"), text("c")
    ratio = 0.0
    with contextlib.suppress(ValueError, ZeroDivisionError):
        ratio = float(text("a")) / float(base)
    drafts = results["c"]["num_drafts"] if isinstance(results["c"], dict) else 0
    return Row(
        f"drafter mean acceptance length in vLLM's EAGLE-3 speculative decoding (CPU build, "
        f"3 draft tokens, greedy, {held} held-out questions, {drafts:.0f} drafts for (c)): "
        "(a) / (b) / (d) vs (c)",
        ours,
        base,
        ratio,
        "info",
    )


def child_env() -> dict[str, str]:
    """The environment of every child: the caller's, less the bench's own switches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_BENCH_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


async def _child(module: str, *args: str, log: Path) -> str:
    """Run ``python -m module args`` from the repository, its stdout and stderr going to
    ``log`` as they come (a long training run can be followed there); the output. A
    failure raises with the output's tail."""
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args,
            cwd=REPO, env=child_env(), stdout=sink, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        status = await proc.wait()
    return await child_output(module, status, log)


def _json_lines(output: str) -> list[dict[str, Any]]:
    """Every line of a child's output that is a JSON object, in order."""
    return [json.loads(line) for line in output.splitlines() if line.startswith('{"')]


def _steps(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def rows(
    scores: dict[str, Any],
    errors: dict[str, list[float]],
    clock: dict[str, float],
    peaks: list[int],
    trained: int,
    held: int,
    size: Size,
) -> list[Row]:
    """The table rows: one per arm (top-1 at steps 0 / 1 / 2 against (c)), the
    acceptance-length estimate, and the run's data and cost."""
    reference = scores["c"]["top1"]
    targets = {
        "a": "within 0.02 of (c)",
        "b": "within 0.02 of (c)",
        "c": "the reference of (a), (b), (d)",
        "d": "at least 0.1 below (c)",
    }
    out = []
    for arm, label in ARMS.items():
        top1 = scores[arm]["top1"]
        versus = "" if arm == "c" else f" vs {ARMS['c']}"
        out.append(
            Row(
                f"drafter top-1 agreement, held-out, {label}{versus} (step 0 / 1 / 2)",
                _steps(top1),
                "-" if arm == "c" else _steps(reference),
                top1[0] / reference[0] if reference[0] else 0.0,
                targets[arm],
            )
        )
    lengths = {arm: scores[arm]["acceptance_length"] for arm in ARMS}
    out.append(
        Row(
            "drafter acceptance length, held-out, teacher-forced estimate with 3 draft "
            "tokens (not vLLM's): (a) / (b) / (d) vs (c)",
            " / ".join(f"{lengths[a]:.2f}" for a in "abd"),
            f"{lengths['c']:.2f}",
            lengths["a"] / lengths["c"],
            "info",
        )
    )
    positions = scores["a"]["positions"]
    minutes = {name: seconds / 60 for name, seconds in clock.items()}
    train_min = " / ".join(f"{minutes[f'train {a}']:.1f}" for a in ARMS)
    out.append(
        Row(
            f"drafter data and cost: {trained} training and {held} held-out conversations "
            f"({positions[0]} scored positions at step 0), {size.epochs} epoch"
            f"{'s' if size.epochs > 1 else ''}; hsx states "
            f"vs transformers float32, worst relative error per sample and layer: raw "
            f"{max(errors['raw']):.1e}, fp8 {max(errors['fp8']):.1e}; peak RSS of a "
            f"training process {max(peaks)} MiB",
            f"{sum(minutes.values()):.1f} min",
            f"hsx {minutes['hsx']:.1f}, reference {minutes['reference']:.1f}, train "
            f"{train_min}, score {minutes['score']:.1f}, vLLM {minutes['vLLM']:.1f} min",
            1.0,
            "info",
        )
    )
    return out
