"""Mean acceptance length of one trained drafter in vLLM's own EAGLE-3 speculative decoding.

``python -m benchmarks.drafter.vllm_accept MODEL CHECKPOINT QUESTIONS MAX_TOKENS`` starts
vLLM (the CPU build) on the target MODEL in float32 with CHECKPOINT (a speculators
EAGLE-3 checkpoint, as ``speculators train`` saved it) as the drafter proposing 3
tokens, answers every question of QUESTIONS (a JSON list) greedily through its chat
template, and prints one JSON line: vLLM's counters ``spec_decode_num_drafts``,
``num_draft_tokens``, ``num_accepted_tokens``, the accepted tokens per draft position,
and the mean acceptance length ``1 + accepted / drafts`` (vLLM's definition: the bonus
token the target always emits plus the accepted draft tokens, per verification step).

One drafter per process: the engine's memory goes back when it exits. Eager mode
(``enforce_eager``): compiling the graphs on this CPU costs minutes and changes no count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: Draft tokens per step: the depth the drafters were trained to (3 TTT steps).
SPECULATIVE_TOKENS = 3


def measure(model: str, checkpoint: str, questions: list[str], max_tokens: int) -> dict:
    """Run the questions through vLLM with the drafter; vLLM's speculative counters."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; docs/cpu.md says why
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        disable_log_stats=False,  # the spec-decode counters are stats
        seed=0,
        speculative_config={
            "method": "eagle3",
            "model": checkpoint,
            "num_speculative_tokens": SPECULATIVE_TOKENS,
        },
    )
    chats = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
    counters: dict[str, float | list[float]] = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if metric.name.startswith("vllm:spec_decode_"):
            counters[name] = getattr(metric, "values", None) or metric.value
    drafts = float(counters.get("num_drafts", 0.0))  # type: ignore[arg-type]
    accepted = float(counters.get("num_accepted_tokens", 0.0))  # type: ignore[arg-type]
    return {
        **counters,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def main() -> None:
    """CLI: MODEL CHECKPOINT QUESTIONS_JSON MAX_TOKENS."""
    model, checkpoint, questions, max_tokens = sys.argv[1:5]
    result = measure(model, checkpoint, json.loads(Path(questions).read_text()), int(max_tokens))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
