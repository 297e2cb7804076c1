"""``hsx dataset verify --parity K``: stored states against an independent forward pass.

Checksums prove an object is the one the server wrote, not that the server wrote the
right states: all-zero layers, rows shifted by one, an off-by-one layer id or another
checkpoint all pass them. Parity samples K ``ok`` rows, recomputes their states with
Hugging Face transformers on this machine for the stored ``token_ids``, and compares
each stored layer (relative error ``‖stored - ref‖ / ‖ref‖`` and cosine).

Layer convention (hsx's, as ``tests/engine/reference.py`` checks the engine against
it): id ``i < L`` is transformers' ``hidden_states[i]`` (the input of decoder layer
``i``; 0 is the embeddings) and id ``L`` (``num_hidden_layers``) is the last decoder
layer's output *before* the final norm, captured with a forward hook (transformers'
own last entry is after the norm).

The sample is spread over lengths: the ``ok`` rows of every shard, pooled and sorted by
token count, are cut into K quantile buckets and one row is drawn from each with
``random.Random(seed)``, so the same seed draws the same rows.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from service.dataset.manifest import Job, Record
from service.dataset.model_choice import (
    ParityError,
    check_downloaded,
    choose_model,
    recorded_weights,
)
from service.dataset.store import RunStore

if TYPE_CHECKING:
    import torch

    from service.client import AsyncHsxClient

PARITY = "parity.json"
CONVENTION = (
    "layer id i < num_hidden_layers is transformers' hidden_states[i] (the input of "
    "decoder layer i, 0 = embeddings); id num_hidden_layers is the last decoder layer's "
    "output before the final norm"
)
#: Largest relative error of one stored layer against transformers, by the run's model
#: dtype. float32: hsx on CPU measures up to 5e-6 on the tiny model and 2.7e-5 on
#: SmolLM2's last layer (30 layers deep; tests/dataset/test_parity.py), growing with
#: depth, so 1e-3 leaves ~40x for deeper models and longer rows and stays two orders
#: under the corruptions it must catch (measured on the tiny model: an all-zero layer
#: 1.0, the next layer swapped in 1.1, rows shifted by one 0.9..1.1).
#: Half precisions differ by kernels' accumulation order compounded over the layers:
#: bfloat16 keeps 8 bits of mantissa (2^-8 = 3.9e-3 per rounding), float16 11; their
#: bounds allow a dozen roundings' worth of drift and are not measured here yet.
DTYPE_BOUNDS = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
#: What a lossy codec adds on top (its documented per-row bound, ``service/codecs.py``):
#: fp8 keeps every token row under 3% relative error (``FP8_SCALE_STEPS``); bf16 rounds
#: float32 states to 8 mantissa bits, at most 2^-9 relative per value.
CODEC_BOUNDS = {"raw": 0.0, "lossless": 0.0, "bf16": 2.0**-9, "fp8": 3e-2}


def bound_for(dtype: str, codec: str) -> float:
    """The relative-error bound of one stored layer for a run's dtype and codec."""
    if dtype not in DTYPE_BOUNDS:
        raise ParityError(f"no parity bound for dtype {dtype!r}")
    if codec not in CODEC_BOUNDS:
        raise ParityError(f"no parity bound for codec {codec!r}")
    return DTYPE_BOUNDS[dtype] + CODEC_BOUNDS[codec]


class LayerParity(BaseModel):
    """One stored layer of one row against the reference."""

    layer: int
    relative_error: float
    cosine: float
    ok: bool


class RowParity(BaseModel):
    """One sampled row: every stored layer, or why it could not be compared."""

    row: int
    custom_id: str
    key: str
    run: str = Field(description="The run directory (the output, or one shard's).")
    num_tokens: int
    layers: list[LayerParity] = Field(default_factory=list)
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and all(layer.ok for layer in self.layers)

    def worst(self) -> LayerParity | None:
        """The layer with the largest relative error."""
        return max(self.layers, key=lambda layer: layer.relative_error, default=None)


class ParityReport(BaseModel):
    """``parity.json``: what was compared, against what, and how far apart."""

    model: str
    dtype: str
    codec: str
    device: str
    seed: int
    requested: int
    bound: float = Field(description="Largest relative error a layer may have.")
    min_cosine: float = Field(description="Smallest cosine a layer may have.")
    convention: str = CONVENTION
    rows: list[RowParity] = Field(default_factory=list)
    load_s: float = 0.0
    compare_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    def failures(self) -> list[RowParity]:
        return [row for row in self.rows if not row.ok]

    def lines(self, worst: int = 5) -> list[str]:
        """A head line, every failed row's layers, and the worst rows."""
        failed = self.failures()
        head = (
            f"parity: {len(self.rows)} rows against {self.model} ({self.dtype}, codec "
            f"{self.codec}, {self.device}), bound {self.bound:.3g}: {len(failed)} failed"
        )
        out = [head, f"  layer convention: {self.convention}"]
        for row in failed:
            out.append(f"  FAIL {_describe(row, only_failed=True)}")
        ranked = sorted(self.rows, key=_worst_error, reverse=True)
        out += [f"  worst: {_describe(row)}" for row in ranked[:worst] if row.ok]
        return out


def _worst_error(row: RowParity) -> float:
    worst = row.worst()
    return float("inf") if worst is None else worst.relative_error


def _describe(row: RowParity, only_failed: bool = False) -> str:
    """One line: the row, then its failed layers (``only_failed``) or its worst one."""
    where = f"row {row.row} ({row.custom_id}, {row.num_tokens} tokens)"
    if row.problem is not None:
        return f"{where}: {row.problem}"
    worst = row.worst()
    if only_failed:
        layers = [layer for layer in row.layers if not layer.ok]
    else:
        layers = [worst] if worst is not None else []
    parts = [
        f"layer {layer.layer}: relative error {layer.relative_error:.3g}, cosine {layer.cosine:.6f}"
        for layer in layers
    ]
    return f"{where}: " + "; ".join(parts)


@dataclass(frozen=True)
class Sampled:
    """A sampled ``ok`` row and the run directory whose manifest holds it."""

    store: RunStore
    job: Job
    record: Record


def sample(candidates: Sequence[Sampled], k: int, seed: int) -> list[Sampled]:
    """``k`` rows spread over lengths (one per token-count quantile bucket), by ``seed``."""
    pool = sorted(candidates, key=lambda s: (s.record.num_tokens or 0, s.store.url, s.record.row))
    if k >= len(pool):
        return pool
    rng = random.Random(seed)
    picked = []
    for bucket in range(k):
        start, end = bucket * len(pool) // k, (bucket + 1) * len(pool) // k
        picked.append(pool[rng.randrange(start, end)])
    return picked


class Reference:
    """The model loaded with transformers: states by hsx's layer convention."""

    def __init__(self, model: str, dtype: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        try:
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        except (OSError, ValueError) as exc:
            raise ParityError(
                f"cannot load {model!r} with transformers ({type(exc).__name__}); "
                "pass --parity-model with the served model's path or Hugging Face id"
            ) from None
        self.model = loaded.to(device).eval()
        self.layers = _decoder_layers(self.model)

    def states(self, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        """[num_tokens, len(layer_ids), hidden] on the CPU, in float64."""
        import torch

        captured: dict[str, torch.Tensor] = {}

        def keep(_module: Any, _inputs: Any, output: Any) -> None:
            captured["last"] = output[0] if isinstance(output, tuple) else output

        handle = self.layers[-1].register_forward_hook(keep)
        try:
            with torch.no_grad():
                ids = torch.tensor([token_ids], device=self.device)
                out = self.model(ids, output_hidden_states=True)
        finally:
            handle.remove()
        count = len(self.layers)
        if any(not 0 <= i <= count for i in layer_ids):
            raise ParityError(f"layer ids {layer_ids} outside 0..{count} for this model")
        chosen = [captured["last"][0] if i == count else out.hidden_states[i][0] for i in layer_ids]
        return torch.stack(chosen, dim=1).double().cpu()


def _decoder_layers(model: Any) -> Any:
    """The decoder layers (``model.model.layers`` for Llama-family models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ParityError(f"{type(model).__name__}: no decoder layers to hook")
    return layers


def compare(
    stored: torch.Tensor, reference: torch.Tensor, layer_ids: list[int], bound: float
) -> list[LayerParity]:
    """Relative error and cosine of each layer of two [T, L, H] tensors."""
    import torch

    out = []
    for position, layer in enumerate(layer_ids):
        a = stored[:, position].double().flatten()
        b = reference[:, position].double().flatten()
        denominator = float(b.norm())
        error = float((a - b).norm()) / denominator if denominator else float("inf")
        cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        good = error <= bound and cosine >= 1.0 - bound
        out.append(LayerParity(layer=layer, relative_error=error, cosine=cosine, ok=good))
    return out


async def check_rows(
    client: AsyncHsxClient,
    reference: Reference,
    rows: list[Sampled],
    report: ParityReport,
) -> None:
    """Fetch, decode and compare each sampled row (one at a time: the forward pass is
    the cost, and it uses every core already)."""
    from service.dataset.objects import read_states

    for item in rows:
        record, fp = item.record, item.job.fingerprint
        result = RowParity(
            row=record.row,
            custom_id=record.custom_id,
            key=record.key or "",
            run=item.store.url,
            num_tokens=record.num_tokens or 0,
        )
        states, tokens, problem = await read_states(client, item.job, record)
        if problem is not None or states is None or tokens is None:
            result.problem = problem or "no states"
        else:
            expected = await asyncio.to_thread(reference.states, tokens, fp.layer_ids)
            result.layers = compare(states, expected, fp.layer_ids, report.bound)
        report.rows.append(result)


async def parity_check(
    client: AsyncHsxClient,
    root: RunStore,
    runs: list[tuple[RunStore, Job]],
    k: int,
    *,
    model: str | None = None,
    seed: int = 0,
    device: str = "cpu",
    tolerance: float | None = None,
) -> ParityReport:
    """Compare ``k`` sampled rows of ``runs`` with transformers and write ``parity.json``
    into ``root``. ``model``: path or Hugging Face id (default and checks:
    ``model_choice.choose_model``); ``tolerance``: the relative-error bound (default:
    :func:`bound_for` the run). Raises ParityError when the model cannot be used."""
    from service.dataset.manifest import load_records

    model = await asyncio.to_thread(choose_model, model, runs)
    fp = runs[0][1].fingerprint
    bound = tolerance if tolerance is not None else bound_for(fp.dtype, fp.codec)
    candidates = []
    for store, job in runs:
        records = await load_records(store)
        candidates += [Sampled(store, job, r) for r in records.values() if r.status == "ok"]
    report = ParityReport(
        model=model,
        dtype=fp.dtype,
        codec=fp.codec,
        device=device,
        seed=seed,
        requested=k,
        bound=bound,
        min_cosine=1.0 - bound,
    )
    started = time.perf_counter()
    reference = await asyncio.to_thread(Reference, report.model, fp.dtype, device)
    await asyncio.to_thread(check_downloaded, model, recorded_weights(runs))
    report.load_s = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    await check_rows(client, reference, sample(candidates, k, seed), report)
    report.compare_s = round(time.perf_counter() - started, 3)
    await root.write(PARITY, (report.model_dump_json(indent=2) + "\n").encode())
    return report
