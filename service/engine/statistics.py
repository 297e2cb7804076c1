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
widened to float64 once, then five reductions of it), so the temporary memory stays
small whatever the object's size; its cost is in docs/design.md ("Provenance and
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
    totals = torch.zeros(5, layers, dtype=torch.float64)  # sum, sq, abs, norm, max
    counts = torch.zeros(2, layers, dtype=torch.int64)  # zero rows, non-finite
    rows = max(1, CHUNK_VALUES // max(1, layers * hidden))
    for start in range(0, tokens, rows):
        _accumulate(states[start : start + rows], totals, counts)
    sums, sq, absolute, norms, max_abs = totals.tolist()
    zero_rows, non_finite = counts.tolist()
    return LayerStatistics(
        num_tokens=tokens,
        hidden_size=hidden,
        sum=sums,
        sum_sq=sq,
        sum_abs=absolute,
        max_abs=max_abs,
        sum_token_norm=norms,
        zero_rows=zero_rows,
        non_finite=non_finite,
    )


def _accumulate(x: torch.Tensor, totals: torch.Tensor, counts: torch.Tensor) -> None:
    """Add one chunk of token rows [rows, layers, hidden] to the running float64 sums."""
    import torch

    row_sum, row_norm, row_abs, row_max = _row_reductions(x)
    # NaN or Inf anywhere makes its row's sum or max non-finite: only then mask them.
    if not bool(torch.isfinite(row_sum).all() and torch.isfinite(row_max).all()):
        finite = torch.isfinite(x)
        counts[1] += (~finite).sum(dim=(0, 2))
        row_sum, row_norm, row_abs, row_max = _row_reductions(torch.where(finite, x, 0))
    totals[0] += row_sum.sum(dim=0)
    totals[1] += (row_norm * row_norm).sum(dim=0)
    totals[2] += row_abs.sum(dim=0)
    totals[3] += row_norm.sum(dim=0)
    totals[4] = torch.maximum(totals[4], row_max.amax(dim=0))
    counts[0] += (row_max == 0).sum(dim=0)


def _row_reductions(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each token row's sum, L2 norm, sum of ``|x|`` and max of ``|x|`` [rows, layers],
    in float64.

    The chunk is widened to float64 once and every reduction reads that copy: a float64
    reduction of a narrower tensor (``dtype=``) makes its own widened copy each time,
    which was most of this work (three copies a chunk). ``|x|`` overwrites the copy once
    the signed sum and the norm have read it; its sum and max are plain reductions,
    where ``vector_norm``'s 1- and inf-norms take a slow path on the CPU (10x and 30x a
    sum on one thread here). The conversion is exact, so the sums are those of the
    float64 values whatever the states' dtype.
    """
    import torch

    wide = x.to(torch.float64)
    row_sum = wide.sum(dim=2)
    row_norm = torch.linalg.vector_norm(wide, 2, dim=2)
    magnitude = wide.abs_()
    return row_sum, row_norm, magnitude.sum(dim=2), magnitude.amax(dim=2)
