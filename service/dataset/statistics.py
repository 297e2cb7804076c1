"""Per-layer statistics of a run's stored states, and ``verify``'s outlier check.

``statistics.json`` (beside ``summary.json``) sums what the server returns for each
object (``StoredObject.statistics``: float64 sums per layer). An object the server
*found* (stored before, under the row's ``custom_id``: a retry after a crash) comes
without sums, since the engine did not run for it; the runner reads it back and sums it
here (:func:`object_statistics`), so no row is left out. Each ``ok`` manifest line
keeps its object's sums, so the run's statistics are recomputed from the manifest,
the only source of truth, at the end of every session: a resumed run's numbers cover
every session's rows exactly once, whatever was killed when.

The outlier check works on what ``verify`` reads, not on what the server said: each
row's *median* token norm per layer (``median_t ‖x_t‖``). Not the mean: trained models
put "massive activations" on the first token (SmolLM2: 10x the others' norm in the
middle layers), so a 4-token row's mean is several times a 70-token row's, and a
clean run would report its short rows. A layer's norms across a run are roughly
log-normal, so a row is an outlier when the robust z-score of its log norm,
``0.6745 * (log x - median) / MAD``, is over :data:`OUTLIER_Z` (the MAD floored at
:data:`MIN_MAD`, so a run whose rows are all alike does not flag a 10% difference).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping

from pydantic import BaseModel, Field

from service.client.models import LayerStatistics
from service.dataset.manifest import Record

STATISTICS = "statistics.json"
#: Robust z-score over which a row's mean token norm is reported (about 1 in 10^8 for
#: a normal distribution, so a clean run of millions of rows reports none).
OUTLIER_Z = 6.0
#: Floor of the MAD of log norms: with it a row must be ~1.8x off the median to score 6.
MIN_MAD = 0.066
#: Fewer rows than this give no distribution to be an outlier of.
MIN_ROWS = 5


class LayerSummary(BaseModel):
    """One layer's statistics over every stored value of the run."""

    layer: int
    values: int = Field(description="Values summed: token rows x hidden size.")
    token_rows: int
    mean: float
    std: float
    mean_abs: float
    max_abs: float
    mean_token_norm: float
    non_finite_fraction: float
    zero_row_fraction: float


class RunStatistics(BaseModel):
    """``statistics.json``."""

    objects: int = Field(description="ok rows whose sums were summed.")
    objects_without_statistics: int = Field(
        description="ok rows whose server returned no statistics (older servers)."
    )
    tokens: int
    layers: list[LayerSummary]


def run_statistics(records: Collection[Record], layer_ids: list[int]) -> RunStatistics:
    """The run's statistics from its manifest records (``ok`` rows with sums; sums of
    another layer count, which no hsx returns, count as missing rather than fail)."""
    ok = [r for r in records if r.status == "ok"]
    with_sums = [
        r.statistics
        for r in ok
        if r.statistics is not None and len(r.statistics.sum) == len(layer_ids)
    ]
    missing = len(ok) - len(with_sums)
    layers = [_layer(layer_ids[j], j, with_sums) for j in range(len(layer_ids))]
    tokens = sum(s.num_tokens for s in with_sums)
    return RunStatistics(
        objects=len(with_sums), objects_without_statistics=missing, tokens=tokens, layers=layers
    )


def object_statistics(data: bytes, codec: str) -> LayerStatistics:
    """An object's per-layer sums, as the server computes them, from its bytes (a
    lossy codec's decoded states: within its error bound of the server's sums)."""
    import torch

    from service.dataset.objects import decode_tensors

    x = decode_tensors(data, codec)["hidden_states"].double()  # [T, L, H]
    finite = torch.isfinite(x)
    clean = torch.where(finite, x, torch.zeros_like(x))
    norms = clean.norm(dim=-1)  # [T, L]
    return LayerStatistics(
        num_tokens=x.shape[0],
        hidden_size=x.shape[2],
        sum=clean.sum(dim=(0, 2)).tolist(),
        sum_sq=(clean * clean).sum(dim=(0, 2)).tolist(),
        sum_abs=clean.abs().sum(dim=(0, 2)).tolist(),
        max_abs=clean.abs().amax(dim=(0, 2)).tolist() if x.shape[0] else [0.0] * x.shape[1],
        sum_token_norm=norms.sum(dim=0).tolist(),
        zero_rows=(x == 0).all(dim=-1).sum(dim=0).tolist(),
        non_finite=(~finite).sum(dim=(0, 2)).tolist(),
    )


def _layer(layer: int, j: int, sums: list[LayerStatistics]) -> LayerSummary:
    rows = sum(s.num_tokens for s in sums)
    values = sum(s.num_tokens * s.hidden_size for s in sums)
    total = math.fsum(s.sum[j] for s in sums)
    mean = total / values if values else 0.0
    variance = math.fsum(s.sum_sq[j] for s in sums) / values - mean * mean if values else 0.0
    return LayerSummary(
        layer=layer,
        values=values,
        token_rows=rows,
        mean=mean,
        std=math.sqrt(max(variance, 0.0)),
        mean_abs=math.fsum(s.sum_abs[j] for s in sums) / values if values else 0.0,
        max_abs=max((s.max_abs[j] for s in sums), default=0.0),
        mean_token_norm=math.fsum(s.sum_token_norm[j] for s in sums) / rows if rows else 0.0,
        non_finite_fraction=sum(s.non_finite[j] for s in sums) / values if values else 0.0,
        zero_row_fraction=sum(s.zero_rows[j] for s in sums) / rows if rows else 0.0,
    )


def outliers(
    norms: Mapping[int, list[float]], layer_ids: list[int], threshold: float = OUTLIER_Z
) -> list[str]:
    """A line per (row, layer) whose median token norm is an outlier of its layer.

    ``norms``: each row's median token norm per stored layer (in ``layer_ids`` order).
    """
    if len(norms) < MIN_ROWS:
        return []
    found = []
    for j, layer in enumerate(layer_ids):
        logs = {row: math.log(max(values[j], 1e-30)) for row, values in norms.items()}
        median = statistics.median(logs.values())
        mad = max(statistics.median(abs(v - median) for v in logs.values()), MIN_MAD)
        for row, value in sorted(logs.items()):
            score = 0.6745 * (value - median) / mad
            if abs(score) > threshold:
                found.append(
                    f"row {row}: layer {layer} median token norm {norms[row][j]:.4g} is an "
                    f"outlier (robust z {score:+.1f}, run median {math.exp(median):.4g})"
                )
    return found
