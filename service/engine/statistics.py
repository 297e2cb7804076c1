"""Per-layer statistics of one object's states, as the writer stores them.

Silent corruption (all-zero rows, a shifted or swapped layer, a changed checkpoint)
keeps every shape; it shows in the numbers. The writer computes these sums for each
object from the model-dtype states before any lossy codec encodes them, and they travel
back with the object's completion (``wire.StoredObject.statistics``), so a dataset run
adds them up without reading the objects again (``service.client.models.LayerStatistics``
says how). The ``/metrics`` gauge of the mean token norm is fed from them too.

Sums are float64 over the finite values; the writer refuses non-finite states first
(``validation.py``), so ``non_finite`` reads 0 for every stored object. The work is
one pass over the states in chunks of at most ``CHUNK_VALUES`` values (five
float64-accumulating reductions of each chunk), so the temporary memory stays small
whatever the object's size; its cost is in docs/design.md ("Provenance and statistics").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.client.models import LayerStatistics

if TYPE_CHECKING:
    import torch

#: Values reduced at a time. Torch's float64 reductions copy their input to float64
#: first, so a chunk bounds the temporaries (2 MiB each). On one thread of the 2-core
#: test machine 1 << 18 measured 0.41-0.59 ms per MiB of float32-equivalent values,
#: against 0.8-1.1 for 1 << 16 (per-op overhead) and no gain from 1 << 19.
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
    """Add one chunk of token rows [rows, layers, hidden] to the running float64 sums.

    Each statistic is a reduction over the hidden dimension that accumulates in float64
    (``dtype=``), then one over the chunk's rows. ``|x|`` is the one temporary of the
    chunk's size (in its own dtype): its sum and max are plain reductions, where
    ``vector_norm``'s 1- and inf-norms take a slow path on the CPU (10x and 30x a sum on
    one thread here); both propagate NaN alike.
    """
    import torch

    magnitude = x.abs()
    row_sum, row_max = x.sum(dim=2, dtype=torch.float64), magnitude.amax(dim=2)
    # NaN or Inf anywhere makes its row's sum or max non-finite: only then mask them.
    if not bool(torch.isfinite(row_sum).all() and torch.isfinite(row_max).all()):
        finite = torch.isfinite(x)
        counts[1] += (~finite).sum(dim=(0, 2))
        x = torch.where(finite, x, 0)
        magnitude = x.abs()
        row_sum, row_max = x.sum(dim=2, dtype=torch.float64), magnitude.amax(dim=2)
    row_norm = torch.linalg.vector_norm(x, 2, dim=2, dtype=torch.float64)
    totals[0] += row_sum.sum(dim=0)
    totals[1] += (row_norm * row_norm).sum(dim=0)
    totals[2] += magnitude.sum(dim=2, dtype=torch.float64).sum(dim=0)
    totals[3] += row_norm.sum(dim=0)
    totals[4] = torch.maximum(totals[4], row_max.amax(dim=0).to(torch.float64))
    counts[0] += (row_max == 0).sum(dim=0)
