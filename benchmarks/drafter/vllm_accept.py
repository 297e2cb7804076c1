"""Mean acceptance length of trained drafters in vLLM's own EAGLE-3 speculative decoding.

``python -m benchmarks.drafter.vllm_accept MODEL QUESTIONS MAX_TOKENS ARM=CHECKPOINT...``
starts vLLM (the CPU build) on the target MODEL in float32 with each CHECKPOINT (a
speculators EAGLE-3 checkpoint, as ``speculators train`` saved it) in turn as the
drafter proposing 3 tokens, answers every question of QUESTIONS (a JSON list) greedily
through its chat template, and prints one JSON line per ARM: vLLM's counters
``spec_decode_num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, the accepted
tokens per draft position, and the mean acceptance length ``1 + accepted / drafts``
(vLLM's definition: the bonus token the target always emits plus the accepted draft
tokens, per verification step), or ``error`` where that drafter's run failed.

One engine per drafter, one after the other in this process: each engine's processes
(and their memory) are gone before the next starts, and vLLM is imported once rather
than once per drafter. Eager mode (``enforce_eager``): compiling the graphs on this CPU
costs minutes and changes no count.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

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
    try:
        # Each engine registers fresh counters; the difference is taken all the same,
        # so a counter left by the engine before could not leak into this drafter's.
        before = _spec_counters(llm)
        chats = [[{"role": "user", "content": q}] for q in questions]
        outputs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
        counters = _minus(_spec_counters(llm), before)
    finally:
        llm.llm_engine.engine_core.shutdown()  # its processes go before the next starts
        del llm
        gc.collect()
    drafts = float(counters.get("num_drafts", 0.0))  # type: ignore[arg-type]
    accepted = float(counters.get("num_accepted_tokens", 0.0))  # type: ignore[arg-type]
    return {
        **counters,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def _spec_counters(llm: Any) -> dict[str, float | list[float]]:
    counters: dict[str, float | list[float]] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            counters[name] = getattr(metric, "values", None) or metric.value
    return counters


def _minus(
    after: dict[str, float | list[float]], before: dict[str, float | list[float]]
) -> dict[str, float | list[float]]:
    out: dict[str, float | list[float]] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            prior = old if isinstance(old, list) else [0.0] * len(value)
            out[name] = [a - b for a, b in zip(value, prior, strict=False)]
        else:
            out[name] = value - (old if isinstance(old, (int, float)) else 0.0)
    return out


def main() -> None:
    """CLI: MODEL QUESTIONS_JSON MAX_TOKENS ARM=CHECKPOINT...: one JSON line per arm."""
    model, questions_file, max_tokens = sys.argv[1:4]
    from benchmarks.common import fork_engine_server
    from service.config import EngineSettings
    from service.engine.prestart import QueuePolling, use_preloaded_processes

    # Four engines: vLLM imported once for all (by this process; its fork server is
    # forked from it), and its queues polled as hsx's engines poll them by default
    # (this measures acceptance, which the polling does not change).
    use_preloaded_processes(QueuePolling.of(EngineSettings()))
    fork_engine_server()
    questions = json.loads(Path(questions_file).read_text())
    for spec in sys.argv[4:]:
        arm, checkpoint = spec.split("=", 1)
        try:
            result = measure(model, checkpoint, questions, int(max_tokens))
        except Exception as exc:  # the row says why instead of losing the other arms
            result = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        print(json.dumps({"arm": arm, **result}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: guard the entry point
    main()
