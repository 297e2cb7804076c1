"""Checks on the states before they are stored: finite, and no layer all zeros.

vLLM has shipped all-zero and NaN hidden states before (vLLM #51328, #45734, #46301:
slots rebuilt with the wrong block size, hybrid state mix-ups); a drafter trained on
them learns nothing, silently. The writer runs this on its own thread, off the forward
pass: two reductions per layer (max and min, which both propagate NaN), no temporary
copy of the tensor. Its cost is in docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.errors import InvalidStatesError


def check_states(states: torch.Tensor, layer_ids: Sequence[int] | None = None) -> None:
    """Raise InvalidStatesError unless ``states`` [tokens, layers, hidden] is valid.

    Valid: every value finite, and every layer holds a non-zero value somewhere in the
    prompt. ``layer_ids`` name the layers in the message (positions otherwise).
    """
    names = list(layer_ids) if layer_ids is not None else list(range(states.shape[1]))
    if states.numel() == 0:
        return
    # NaN propagates through both; +Inf shows in the max, -Inf in the min.
    high, low = states.amax(dim=(0, 2)), states.amin(dim=(0, 2))
    non_finite = ~(torch.isfinite(high) & torch.isfinite(low))
    if bool(non_finite.any()):
        bad = [names[i] for i in non_finite.nonzero().flatten().tolist()]
        raise InvalidStatesError(
            f"hidden states of layer ids {bad} hold NaN or Inf; nothing was stored",
            "non_finite",
        )
    all_zero = (high == 0) & (low == 0)
    if bool(all_zero.any()):
        zero = [names[i] for i in all_zero.nonzero().flatten().tolist()]
        raise InvalidStatesError(
            f"hidden states of layer ids {zero} are all zeros over the prompt's "
            f"{states.shape[0]} tokens; nothing was stored",
            "all_zero_layer",
        )
