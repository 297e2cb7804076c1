"""Codec benchmarks: bytes per token and extraction throughput of each codec against ``raw``.

One engine at a time serves a small random-weight Llama (hidden 512, so fp8's float32
scale per row weighs what it would on a real model: 4 bytes per 512 values). The same
prompts go through every codec, each batch paired with a ``raw`` batch next to it, so
drift in the machine's load hits both alike. Encoding
runs in the worker's writer threads; its CPU cost is measured here on the same states,
one thread, as the writer runs it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Timer
from service import codecs
from service.config import Settings

#: The start of every row this bench writes (``benchmarks.run --only`` replaces them).
ROW_PREFIXES = ("fp8 vs raw", "bf16 vs raw", "lossless vs raw")

NOTES = """- **codecs, bytes per token**: the mean stored object size per prompt token (header
  included) for 32 prompts of 32-256 tokens on a random-weight Llama (hidden 512, 4
  layers, layer ids [1, 2, 4]) served in bfloat16 (targets: `lossless` at most 0.72x
  `raw`, `fp8` at most 0.51x) and in float32 (`bf16` is offered there only).
- **codecs, throughput**: prompt tokens per second of the same 32 prompts extracted
  with each codec (prefix caching off, so each run computes every prompt). After a
  warm-up round, each of 16 rounds runs every codec's batch paired with a `raw` batch
  right before or after it (alternating); the ratio is the median of those pairs'
  `raw` time / codec time (target for `lossless` on bfloat16 states: at least 0.95),
  and the row names the lowest and highest pair. The tok/s columns are medians of the
  batch times. Pairs a second apart cancel slow drift in other processes' load, not
  bursts: on a busy 2-core machine a ratio still moves by several hundredths between
  runs, and the spread in the row name shows how busy the machine was. The byte
  ratios are exact. `codec_bench.run(..., quick=True)`: 2 prompts, 1 round, eager
  engines (no compilation): it shows that the bench runs.
- **codecs, encode CPU**: CPU time (one thread, as in the writer) to encode 1 MB of
  the model-dtype states those prompts produced, against `raw` (a safetensors write);
  the median of 5 passes over all states, codecs interleaved. `lossless` costs a shift
  per byte plane (numpy), zstd on the exponent plane (strategy fast, a 64-entry hash
  table, 7-byte matches: Huffman coding does the work; layer-major, a zstd block per
  layer, so each layer's exponents get their own Huffman table) and the safetensors
  write.
- Random-weight models' activations compress differently from trained ones: their
  states are close to Gaussian, while trained models have massive outlier channels and
  scales that differ by layer, which change both the exponent plane's entropy (so
  `lossless`'s ratio) and fp8's error per row. The literature measures real models:
  splitting bf16 into byte planes and compressing the exponent plane with zstd gives
  about 1.43x (0.70x the bytes) on Qwen3 hidden states (BloomBee PR #59); plain zstd on
  whole files about 1.27x (0.79x; vLLM PR #35425); fp8 halves bf16 (0.50x plus 4 bytes
  per row of scales) and moved EAGLE-3 acceptance length by at most ~0.05 on Qwen3-8B
  (speculators #461/#491/#1028). Measure on your model before sizing storage.
"""

HIDDEN = 512


@dataclass(frozen=True)
class Plan:
    """How much the bench measures: the full run, or a quick one for CI-sized checks."""

    prompts: int = 32
    rounds: int = 16
    cpu_passes: int = 5
    #: No graph compilation at engine start (vLLM's CPU default compiles with inductor,
    #: which costs far more than a quick run measures).
    eager: bool = False


#: Every path once at the smallest size: two prompts, one round, one CPU pass.
QUICK = Plan(prompts=2, rounds=1, cpu_passes=1, eager=True)


def make_bench_model(out: Path) -> Path:
    """A random-weight Llama with hidden size 512 and the demo model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from service.engine.tiny_models import make_tokenizer

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, 512)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out)
    return out


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(32, 257))] for _ in range(count)]


@dataclass
class Measured:
    """Stored bytes, batch times and per-round throughput ratios against ``raw``."""

    sizes: dict[str, int] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    raw: list[Any] = field(default_factory=list)  # the latest raw batch's results

    def throughput_ratio(self, codec: str) -> float:
        """Median of the rounds' ratios: each compares two batches run back to back."""
        return statistics.median(self.ratios[codec])


async def _measure(
    extractor: Any, prompts: list[list[int]], timer: Timer, codec_names: list[str], rounds: int
) -> Measured:
    """Per round (round 0 warms up), each codec's batch of ``prompts`` paired with a
    ``raw`` batch right before or after it (alternating), so each ratio compares two
    batches a second apart, whatever the machine's other load does meanwhile."""
    measured = Measured(times={c: [] for c in codec_names})
    for round_ in range(rounds + 1):
        for codec in (c for c in codec_names if c != "raw"):
            pair = ["raw", codec] if round_ % 2 else [codec, "raw"]
            elapsed = {c: await _batch(extractor, prompts, timer, c, measured) for c in pair}
            if round_:
                for name, seconds in elapsed.items():
                    measured.times[name].append(seconds)
                measured.ratios.setdefault(codec, []).append(elapsed["raw"] / elapsed[codec])
    return measured


async def _batch(
    extractor: Any, prompts: list[list[int]], timer: Timer, codec: str, measured: Measured
) -> float:
    """Seconds to extract ``prompts`` with ``codec``; records the stored bytes and keeps
    only the latest ``raw`` objects (their states are read afterwards)."""
    results: list[Any] = []

    async def batch() -> None:
        results[:] = await asyncio.gather(
            *(extractor.extract(p, extractor.request_params("bench", codec=codec)) for p in prompts)
        )

    (seconds,) = await timer(batch, 1)
    measured.sizes[codec] = sum(r.size for r in results)
    stale = measured.raw if codec == "raw" else results
    if codec == "raw":
        measured.raw = results
    for r in stale:  # keep the disk small
        await extractor.storage.delete(r.key)
    return seconds


def _encode_ms_per_mb(
    states: list[Any], token_ids: list[Any], codec_names: list[str], passes: int
) -> dict[str, float]:
    """CPU milliseconds to encode 1 MB of model-dtype states, on one thread (as the
    writer does): the median of ``passes`` passes over all states, codecs interleaved."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mb = sum(s.numel() * s.element_size() for s in states) / 1e6
    cpu: dict[str, list[float]] = {c: [] for c in codec_names}
    try:
        for _ in range(passes):
            for codec in codec_names:
                start = time.thread_time()
                for s, ids in zip(states, token_ids, strict=True):
                    meta = {"model": "bench", "dtype": codecs.dtype_name(s.dtype)}
                    b"".join(codecs.pack_parts(codec, codecs.prepare(codec, s), ids, meta))
                cpu[codec].append((time.thread_time() - start) * 1000 / mb)
    finally:
        torch.set_num_threads(threads)
    return {c: statistics.median(t) for c, t in cpu.items()}


async def _run_dtype(scratch: Path, model: Path, dtype: str, timer: Timer, plan: Plan) -> list[Row]:
    from safetensors.torch import load

    from service.engine.extractor import Extractor

    settings = Settings(
        engine={
            "model": str(model),
            "dtype": dtype,
            "max_model_len": 1024,
            "cpu_kvcache_space_gib": 1,
            "gpu_memory_utilization": 0.5,
            "enable_prefix_caching": False,
            **({"extra_args": {"enforce_eager": True}} if plan.eager else {}),
        },
        storage={"url": str(scratch / f"codec-objects-{dtype}")},
    )
    prompts = _prompts(plan.prompts)
    tokens = sum(len(p) for p in prompts)
    extractor = await Extractor.start(settings)
    try:
        names = extractor.codecs
        measured = await _measure(extractor, prompts, timer, names, plan.rounds)
        tensors = [load(await extractor.storage.get(r.key)) for r in measured.raw]
    finally:
        await extractor.close()
    states = [t["hidden_states"] for t in tensors]
    ids = [t["token_ids"] for t in tensors]
    cpu = _encode_ms_per_mb(states, ids, names, plan.cpu_passes)
    label = f"{tokens} tokens, {plan.rounds} rounds"
    return [
        row
        for codec in names
        if codec != "raw"
        for row in _codec_rows(codec, dtype, tokens, label, measured, cpu)
    ]


def _codec_rows(
    codec: str, dtype: str, tokens: int, label: str, measured: Measured, cpu: dict[str, float]
) -> list[Row]:
    """Bytes per token, throughput and encode CPU of ``codec`` against ``raw``."""
    sizes = measured.sizes
    times = {c: statistics.median(t) for c, t in measured.times.items()}
    target = {("lossless", "bfloat16"): "<= 0.72", ("fp8", "bfloat16"): "<= 0.51"}
    name = f"{codec} vs raw, {dtype} states"
    ratios = measured.ratios[codec]
    return [
        Row(
            f"{name}: bytes per token",
            f"{sizes[codec] / tokens:.0f} B",
            f"{sizes['raw'] / tokens:.0f} B",
            sizes[codec] / sizes["raw"],
            target.get((codec, dtype), "info"),
        ),
        Row(
            f"{name}: throughput ({label}, {min(ratios):.2f}-{max(ratios):.2f})",
            f"{tokens / times[codec]:.0f} tok/s",
            f"{tokens / times['raw']:.0f} tok/s",
            measured.throughput_ratio(codec),
            ">= 0.95" if (codec, dtype) == ("lossless", "bfloat16") else "info",
        ),
        Row(
            f"{name}: encode CPU per MB",
            f"{cpu[codec]:.1f} ms",
            f"{cpu['raw']:.1f} ms",
            cpu[codec] / cpu["raw"],
            "info",
        ),
    ]


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """Rows for bfloat16 states (the targets), then float32 (where bf16 is offered).

    ``quick``: fewer prompts, rounds and CPU passes, for CI-sized runs (noisier ratios).
    """
    plan = QUICK if quick else Plan()
    model = make_bench_model(scratch / "codec-model")
    rows = await _run_dtype(scratch, model, "bfloat16", timer, plan)
    return rows + await _run_dtype(scratch, model, "float32", timer, plan)
