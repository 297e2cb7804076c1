"""``hsx dataset verify --parity K``: stored states against an independent forward pass.

Checksums prove an object is the one the server wrote, not that the server wrote the
right states: all-zero layers, rows shifted by one, an off-by-one layer id or another
checkpoint all pass them. Parity samples K ``ok`` rows, recomputes their states with
Hugging Face transformers on this machine for the stored ``token_ids``, and compares
each stored layer (relative error ``‖stored - ref‖ / ‖ref‖`` and cosine).

Two rules judge the comparison (``rule_for``):

- **norm** (float32 runs, or any run given ``tolerance``): a layer of a row fails when
  its relative error is over the bound (``bound_for``) or its cosine under ``1 - bound``.
- **gap** (bfloat16 and float16 runs): the reference is computed twice, in float32 and
  in the run's dtype, and hsx's per-token errors against float32 are held to the
  reference's own half-precision gap from float32, per layer. One norm over a row
  cannot be: in a mixture of experts a token whose 2nd and 3rd expert scores tie within
  bfloat16 rounding is sent to either, in transformers and in hsx alike, and lands
  0.3-0.6 off float32; a few such tokens carry a row's norm past any fixed bound (27 of
  96 rows of the tiny Qwen3-Next over 5e-2). What stays comparable is the distribution:
  a layer of a row fails when more of its tokens are off the float32 path (more than
  ``bound`` from it) than ``OFF_PATH_FACTOR`` times the reference's count on the same
  tokens plus ``OFF_PATH_SLACK``; a layer of the whole sample fails on the same count
  over all sampled tokens, or when hsx's median token error is over the reference's
  75th percentile. A corrupt layer puts every token of its row off the path (0.9-1.1).

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
from typing import TYPE_CHECKING, Any, Literal

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
#: Dtypes judged by the gap rule (module docstring). Their ``DTYPE_BOUNDS`` entry is the
#: per-token distance from float32 past which a token counts as off the float32 path:
#: 5e-2 for bfloat16 is ~13 roundings of 2^-8, over the 4e-3..1.1e-2 median token
#: error measured on the tiny Qwen3-Next, and under the 0.3-0.6 of a routing tie.
HALF = ("bfloat16", "float16")
#: hsx may have this many times the reference's off-path tokens, plus the slack: ties
#: fall at random in either run (measured on the tiny Qwen3-Next, 2,587 tokens: hsx
#: 2, 8, 13, 47 per layer against transformers' 4, 16, 33, 126).
OFF_PATH_FACTOR = 2
OFF_PATH_SLACK = 2
#: hsx's median token error may reach this quantile of the reference's: hsx's median
#: was 0.59-0.87 of transformers' 75th percentile over 2,587 tokens, but over a few
#: hundred tokens its last layer's median came out 0.9-1.2 of transformers' median.
MEDIAN_QUANTILE = 0.75
Rule = Literal["norm", "gap"]


def rule_for(dtype: str, tolerance: float | None) -> Rule:
    """``gap`` for a half-precision run, else (or with a ``tolerance``) ``norm``."""
    return "gap" if dtype in HALF and tolerance is None else "norm"


def bound_for(dtype: str, codec: str) -> float:
    """The relative-error bound for a run's dtype and codec: of one stored layer (the
    norm rule), or of one token on the float32 path (the gap rule)."""
    if dtype not in DTYPE_BOUNDS:
        raise ParityError(f"no parity bound for dtype {dtype!r}")
    if codec not in CODEC_BOUNDS:
        raise ParityError(f"no parity bound for codec {codec!r}")
    return DTYPE_BOUNDS[dtype] + CODEC_BOUNDS[codec]


class LayerParity(BaseModel):
    """One stored layer of one row against the reference (float32's, under the gap
    rule, which also fills the token counts and medians)."""

    layer: int
    relative_error: float
    cosine: float
    ok: bool
    #: Tokens more than the bound from float32: hsx's, and the reference's own in the
    #: run's dtype (gap rule).
    off_path: int | None = None
    reference_off_path: int | None = None
    median: float | None = Field(None, description="hsx's median token error (gap rule).")
    reference_median: float | None = None


class LayerGap(BaseModel):
    """Gap rule: one layer over every sampled token, hsx against the reference's own
    half-precision gap from float32."""

    layer: int
    tokens: int
    median: float = Field(description="hsx's median token error against float32.")
    reference_median: float
    median_bound: float = Field(
        description="The reference's MEDIAN_QUANTILE token error, plus the codec's bound."
    )
    off_path: int
    reference_off_path: int
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
    rule: Rule = "norm"
    bound: float = Field(
        description="norm rule: the largest relative error a layer may have; gap rule: "
        "the distance from float32 past which a token is off the float32 path."
    )
    min_cosine: float | None = Field(description="Smallest cosine a layer may have (norm).")
    convention: str = CONVENTION
    rows: list[RowParity] = Field(default_factory=list)
    layers: list[LayerGap] = Field(
        default_factory=list, description="Gap rule: each layer over all sampled tokens."
    )
    load_s: float = 0.0
    compare_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows) and all(layer.ok for layer in self.layers)

    def failures(self) -> list[RowParity]:
        return [row for row in self.rows if not row.ok]

    def lines(self, worst: int = 5) -> list[str]:
        """A head line, every failed row's layers, and the worst rows."""
        failed = self.failures()
        head = (
            f"parity: {len(self.rows)} rows against {self.model} ({self.dtype}, codec "
            f"{self.codec}, {self.device}), bound {self.bound:.3g}: {len(failed)} failed"
        )
        if self.rule == "gap":
            bad = sum(not layer.ok for layer in self.layers)
            head = (
                f"parity: {len(self.rows)} rows against {self.model} ({self.dtype}, codec "
                f"{self.codec}, {self.device}), held to transformers' own {self.dtype} gap "
                f"from float32 (tokens more than {self.bound:.3g} off: at most "
                f"{OFF_PATH_FACTOR}x its count + {OFF_PATH_SLACK}; median token error: at "
                f"most its {MEDIAN_QUANTILE:.0%} quantile): {len(failed)} failed, "
                f"{bad} layers failed"
            )
        out = [head, f"  layer convention: {self.convention}"]
        out += [_describe_gap(layer, self.dtype, self.bound) for layer in self.layers]
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
        f"layer {layer.layer}: relative error {layer.relative_error:.3g}, cosine "
        f"{layer.cosine:.6f}{_off_path(layer, row.num_tokens)}"
        for layer in layers
    ]
    return f"{where}: " + "; ".join(parts)


def _off_path(layer: LayerParity, tokens: int) -> str:
    if layer.off_path is None:
        return ""
    return (
        f", {layer.off_path} of {tokens} tokens off the float32 path "
        f"(transformers' own: {layer.reference_off_path})"
    )


def _describe_gap(layer: LayerGap, dtype: str, bound: float) -> str:
    mark = "FAIL " if not layer.ok else ""
    return (
        f"  {mark}layer {layer.layer} over {layer.tokens} tokens: median token error "
        f"{layer.median:.3g} (transformers {dtype}: {layer.reference_median:.3g}, bound "
        f"{layer.median_bound:.3g}); {layer.off_path} tokens more than {bound:.3g} off "
        f"(transformers {dtype}: {layer.reference_off_path})"
    )


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


def token_errors(stored: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[T, L] relative error of each token row of two [T, L, H] tensors (float64):
    ``‖stored[t] - ref[t]‖ / ‖ref[t]‖``, infinite where the reference row is zero."""
    difference = (stored.double() - reference.double()).norm(dim=-1)
    norms = reference.double().norm(dim=-1)
    return difference / norms


def compare_gap(
    stored: torch.Tensor,
    float32: torch.Tensor,
    served: torch.Tensor,
    layer_ids: list[int],
    bound: float,
) -> tuple[list[LayerParity], torch.Tensor, torch.Tensor]:
    """The gap rule on one row: each layer of ``stored`` against ``float32``, judged by
    how far the reference's own states in the run's dtype (``served``) are from it.
    Returns the layers and the [T, L] token errors of hsx and of the reference (which
    :func:`layer_gaps` pools over the sample)."""
    ours, theirs = token_errors(stored, float32), token_errors(served, float32)
    layers = compare(stored, float32, layer_ids, bound)
    for position, layer in enumerate(layers):
        mine, their = ours[:, position], theirs[:, position]
        layer.off_path, layer.reference_off_path = _off(mine, bound), _off(their, bound)
        layer.median, layer.reference_median = float(mine.median()), float(their.median())
        layer.ok = _few_off(layer.off_path, layer.reference_off_path)
    return layers, ours, theirs


def layer_gaps(
    ours: torch.Tensor, theirs: torch.Tensor, layer_ids: list[int], bound: float, codec: float
) -> list[LayerGap]:
    """The gap rule on every sampled token ([tokens, L] errors of hsx and of the
    reference): few tokens off the path, and hsx's median token error at most the
    reference's ``MEDIAN_QUANTILE`` (plus ``codec``, the codec's bound: it moves a token's
    error by at most that much)."""
    out = []
    for position, layer in enumerate(layer_ids):
        mine, their = ours[:, position], theirs[:, position]
        median_bound = float(their.quantile(MEDIAN_QUANTILE)) + codec
        off, their_off = _off(mine, bound), _off(their, bound)
        median = float(mine.median())
        gap = LayerGap(
            layer=layer,
            tokens=int(mine.numel()),
            median=median,
            reference_median=float(their.median()),
            median_bound=median_bound,
            off_path=off,
            reference_off_path=their_off,
            ok=median <= median_bound and _few_off(off, their_off),
        )
        out.append(gap)
    return out


def _off(errors: torch.Tensor, bound: float) -> int:
    """Tokens more than ``bound`` from float32 (NaN counts: a non-finite state is off)."""
    return int((~(errors <= bound)).sum())


def _few_off(off: int, reference_off: int) -> bool:
    return off <= OFF_PATH_FACTOR * reference_off + OFF_PATH_SLACK


async def check_rows(
    client: AsyncHsxClient,
    references: list[Reference],
    rows: list[Sampled],
    report: ParityReport,
) -> None:
    """Fetch, decode and compare each sampled row (one at a time: the forward pass is
    the cost, and it uses every core already). ``references``: the run's dtype's, or
    (gap rule) float32's and then the run's dtype's."""
    from service.dataset.objects import read_states

    errors: list[tuple[torch.Tensor, torch.Tensor]] = []
    layer_ids: list[int] = []
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
            expected = [
                await asyncio.to_thread(reference.states, tokens, fp.layer_ids)
                for reference in references
            ]
            if report.rule == "gap":
                float32, served = expected
                result.layers, ours, theirs = compare_gap(
                    states, float32, served, fp.layer_ids, report.bound
                )
                errors.append((ours, theirs))
                layer_ids = fp.layer_ids
            else:
                result.layers = compare(states, expected[0], fp.layer_ids, report.bound)
        report.rows.append(result)
    if errors:
        import torch

        ours, theirs = (torch.cat(part) for part in zip(*errors, strict=True))
        codec = CODEC_BOUNDS.get(report.codec, 0.0)
        report.layers = layer_gaps(ours, theirs, layer_ids, report.bound, codec)


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
    ``model_choice.choose_model``); ``tolerance``: a relative-error bound per layer (the
    norm rule, whatever the dtype; default: :func:`rule_for` and :func:`bound_for` the
    run). Raises ParityError when the model cannot be used."""
    from service.dataset.manifest import load_records

    model = await asyncio.to_thread(choose_model, model, runs)
    fp = runs[0][1].fingerprint
    rule = rule_for(fp.dtype, tolerance)
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
        rule=rule,
        bound=bound,
        min_cosine=1.0 - bound if rule == "norm" else None,
    )
    started = time.perf_counter()
    # The gap rule needs float32's states and the run dtype's own (twice the memory).
    dtypes = ["float32", fp.dtype] if rule == "gap" else [fp.dtype]
    references = [await asyncio.to_thread(Reference, model, d, device) for d in dtypes]
    await asyncio.to_thread(check_downloaded, model, recorded_weights(runs))
    report.load_s = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    await check_rows(client, references, sample(candidates, k, seed), report)
    report.compare_s = round(time.perf_counter() - started, 3)
    await root.write(PARITY, (report.model_dump_json(indent=2) + "\n").encode())
    return report
