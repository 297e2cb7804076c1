"""Per-layer statistics of one object's states, as the writer stores them.

Silent corruption (all-zero rows, a shifted or swapped layer, a changed checkpoint)
keeps every shape; it shows in the numbers. The writer computes these sums for each
object from the model-dtype states before any lossy codec encodes them, and they travel
back with the object's completion (``wire.StoredObject.statistics``), so a dataset run
adds them up without reading the objects again (``service.client.models.LayerStatistics``
says how). The ``/metrics`` gauge of the mean token norm is fed from them too.

Sums are float64 over the finite values; the writer refuses non-finite states first
(``validation.py``), so ``non_finite`` reads 0 for every stored object. The work is
one pass over the states in chunks of at most ``CHUNK_VALUES`` values (each chunk
widened to float64 once, then four reductions of it into each token row's results,
from which the per-layer totals are taken once), so the temporary memory stays small
whatever the object's size; its cost is in docs/design.md ("Provenance and
statistics").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.client.models import LayerStatistics

if TYPE_CHECKING:
    import torch

#: Values reduced at a time: a chunk bounds the float64 copy each is widened to (2 MiB).
#: On one thread of the 2-core test machine 1 << 18 measured 0.41-0.59 ms per MiB of
#: float32-equivalent values, against 0.8-1.1 for 1 << 16 (per-op overhead) and no gain
#: from 1 << 19 (with a widened copy per reduction, before the one copy per chunk).
CHUNK_VALUES = 1 << 18


def layer_statistics(states: torch.Tensor) -> LayerStatistics:
    """The per-layer sums of ``states`` [num_tokens, num_layers, hidden_size] (any float
    dtype, on the CPU)."""
    import torch

    tokens, layers, hidden = states.shape
    rows = _row_reductions(states)  # sum, L2 norm, sum |x|, max |x| of each token row
    non_finite = torch.zeros(layers, dtype=torch.int64)
    # NaN or Inf anywhere makes its row's sum or max non-finite: only then mask them.
    if not bool(torch.isfinite(rows[0]).all() and torch.isfinite(rows[3]).all()):
        rows = _row_reductions(states, non_finite)
    row_sum, row_norm, row_abs, row_max = rows
    zeros = torch.zeros(layers, dtype=torch.float64)
    totals = torch.stack(
        [
            row_sum.sum(dim=0),
            (row_norm * row_norm).sum(dim=0),
            row_abs.sum(dim=0),
            row_norm.sum(dim=0),
            row_max.amax(dim=0) if tokens else zeros,
        ]
    )
    sums, sq, absolute, norms, max_abs = totals.tolist()
    return LayerStatistics(
        num_tokens=tokens,
        hidden_size=hidden,
        sum=sums,
        sum_sq=sq,
        sum_abs=absolute,
        max_abs=max_abs,
        sum_token_norm=norms,
        zero_rows=(row_max == 0).sum(dim=0).tolist(),
        non_finite=non_finite.tolist(),
    )


def _row_reductions(states: torch.Tensor, non_finite: torch.Tensor | None = None) -> torch.Tensor:
    """Each token row's sum, L2 norm, sum of ``|x|`` and max of ``|x|``, in float64:
    [4, tokens, layers]. With ``non_finite`` (int64 [layers]), NaN and Inf count there
    per layer and are reduced as 0.

    The states go through one float64 buffer of at most ``CHUNK_VALUES`` values, a
    chunk of token rows at a time: each chunk is widened into it once and every
    reduction reads that copy (a float64 reduction of a narrower tensor, ``dtype=``,
    makes its own widened copy each time, which was most of this work). ``|x|``
    overwrites the copy once the signed sum and the norm have read it; its sum and max
    are plain reductions, where ``vector_norm``'s 1- and inf-norms take a slow path on
    the CPU (10x and 30x a sum on one thread here). Each reduction writes its rows of
    one [4, tokens, layers] result, and the per-layer totals are taken from it once:
    the small operations per chunk (checks, running sums) cost more than the reductions
    on objects of a few MiB. The conversion is exact, so the sums are those of the
    float64 values whatever the states' dtype.
    """
    import torch

    tokens, layers, hidden = states.shape
    out = torch.empty(4, tokens, layers, dtype=torch.float64)
    step = max(1, CHUNK_VALUES // max(1, layers * hidden))
    wide = torch.empty(min(step, tokens), layers, hidden, dtype=torch.float64)
    for start in range(0, tokens, step):
        chunk = states[start : start + step]
        end = start + chunk.shape[0]
        buffer = wide[: chunk.shape[0]]
        buffer.copy_(chunk)
        if non_finite is not None:
            non_finite += (~torch.isfinite(buffer)).sum(dim=(0, 2))
            buffer.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        torch.sum(buffer, dim=2, out=out[0, start:end])
        torch.linalg.vector_norm(buffer, 2, dim=2, out=out[1, start:end])
        buffer.abs_()
        torch.sum(buffer, dim=2, out=out[2, start:end])
        torch.amax(buffer, dim=2, out=out[3, start:end])
    return out
