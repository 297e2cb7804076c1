"""What a regenerated object must be, checked against the engine that made it (shared
by the tiny model's tests in tests/api and the demo model's in tests/engine)."""

from __future__ import annotations

from typing import Any

import httpx
import torch
from safetensors.torch import load

from service.engine.wire import Sampling


def greedy(engine: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """The engine (a ``ServerThread``) asked again, greedy, storing nothing."""
    out = engine.call(engine.extractor.generate(prompt, Sampling(max_tokens=max_tokens)))
    return list(out.token_ids)


def check_turns(engine: Any, ids: list[int], turns: list[dict[str, Any]]) -> list[int]:
    """Each turn's tokens are what the engine generates from the stored ids before it;
    returns the mask the turns' spans make (generated and end-of-turn tokens)."""
    mask = [0] * len(ids)
    for turn in turns:
        start, generated = turn["start"], turn["generated"]
        assert ids[start : start + generated] == greedy(engine, ids[:start], generated)
        assert turn["end"] > start + generated or turn["finish_reason"] == "stop"
        for i in range(start, turn["end"]):
            mask[i] = 1
    return mask


def forget_cached_states(engine: Any) -> None:
    """Empty the engine's prefix cache: the next request computes every state again."""
    assert engine.call(engine.extractor.engine.reset_prefix_cache())


def plain_prefill_error(
    engine: Any, client: httpx.Client, ids: list[int], states: torch.Tensor, **request: Any
) -> float:
    """Relative error (max |a - b| over max |b|) of ``states`` against a plain prefill
    of the same ids on the same engine, its prefix cache emptied first."""
    forget_cached_states(engine)
    plain = client.post("/extract", json={"prompts": [{"token_ids": ids}]}, **request)
    assert plain.status_code == 200, plain.text
    key = plain.json()["objects"][0]["key"]
    got = client.get(f"/objects/{key}", **request)
    assert got.status_code == 200, got.text
    reference = load(got.content)["hidden_states"]
    assert states.dtype == reference.dtype
    assert states.shape == reference.shape
    return float(((states - reference).abs().max() / reference.abs().max()).item())
