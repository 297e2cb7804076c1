"""``--vocab-map N``: the draft vocabulary of an export, from its supervised tokens.

A draft model predicts over the ``N`` target tokens most frequent in the training
targets; ``d2t[i]`` is the offset from draft id ``i`` to its target id (``target = i +
d2t[i]``) and ``t2d`` marks the target ids in the draft vocabulary. Counts are over the
loss-masked tokens of the exported rows only (rows left out are not counted), in export
order. Written in two trainers' forms, computed as each computes it:

- speculators 0.9 (``speculators.train.vocab_mapping.build_vocab_mappings_from_
  distribution``): the ``N`` most frequent ids (ties: the smaller id first), topped up
  with the smallest unused ids when fewer than ``N`` occur, sorted ascending;
  ``d2t-{N}.npy`` (int64) and ``t2d-{N}.npy`` (bool, the target vocabulary's length),
  the names ``speculators train --data-path DIR --draft-vocab-size N`` looks for.
- ModelOpt 0.47 (``modelopt.torch.speculative.utils.calibrate_frequent_vocab``):
  ``Counter.most_common(N)`` order (ties: first seen first), not sorted; ``d2t.pt``
  (int64, ``torch.save``). ModelOpt refuses fewer than ``N`` distinct tokens; here the
  same top-up as speculators' is used and counted in the manifest (``padded``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def speculators_maps(
    freq: Counter[int], draft_vocab: int, target_vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' ``(d2t, t2d)`` for token counts ``freq``."""
    import torch

    chosen = sorted(freq, key=lambda t: (-freq[t], t))[:draft_vocab]
    chosen = _top_up(chosen, draft_vocab)
    chosen.sort()
    d2t = torch.tensor(chosen, dtype=torch.long) - torch.arange(draft_vocab, dtype=torch.long)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def modelopt_d2t(freq: Counter[int], draft_vocab: int) -> torch.Tensor:
    """ModelOpt's ``d2t`` for token counts ``freq`` (a Counter filled in export order)."""
    import torch

    chosen = _top_up([t for t, _ in freq.most_common(draft_vocab)], draft_vocab)
    return torch.tensor(chosen, dtype=torch.int64) - torch.arange(draft_vocab, dtype=torch.int64)


def _top_up(chosen: list[int], size: int) -> list[int]:
    """``chosen`` then the smallest ids not in it, up to ``size`` (speculators' rule)."""
    taken = set(chosen)
    out = list(chosen)
    candidate = 0
    while len(out) < size:
        if candidate not in taken:
            out.append(candidate)
        candidate += 1
    return out


def write_vocab_maps(
    dest: Path, freq: Counter[int], draft_vocab: int, target_vocab: int
) -> dict[str, Any]:
    """Both forms into ``dest``; the manifest's record of them."""
    import numpy as np
    import torch

    d2t, t2d = speculators_maps(freq, draft_vocab, target_vocab)
    np.save(dest / f"d2t-{draft_vocab}.npy", d2t.numpy())
    np.save(dest / f"t2d-{draft_vocab}.npy", t2d.numpy())
    torch.save(modelopt_d2t(freq, draft_vocab), dest / "d2t.pt")
    return {
        "draft_vocab_size": draft_vocab,
        "target_vocab_size": target_vocab,
        "distinct_supervised_tokens": len(freq),
        "padded": max(0, draft_vocab - len(freq)),
        "supervised_tokens": sum(freq.values()),
        "files": [f"d2t-{draft_vocab}.npy", f"t2d-{draft_vocab}.npy", "d2t.pt"],
    }
