"""How hsx runs vLLM's parallelism: what it refuses, and why.

A leaf module (settings in, plain values out) that both ``hsx serve``'s start-up
checks (``service.startup``) and the engine builder use, so that the refusal reads the
same wherever it is met.
"""

from __future__ import annotations

from typing import NamedTuple

from service.config import EngineSettings

#: Why hsx refuses pipeline parallelism (docs/design.md says what supporting it takes;
#: tests/engine/test_pp_canary.py notices when vLLM stops refusing it).
PIPELINE_PROBLEM = (
    "vLLM 0.32's extract_hidden_states has no pipeline-parallel support (its extraction "
    "model does not implement SupportsPP; aux states are not relayed between stages)"
)
PIPELINE_FIX = "use tensor_parallel_size or data parallelism"


class Refusal(NamedTuple):
    """A setting hsx refuses: which one, what is wrong, what to do."""

    setting: str
    problem: str
    fix: str


def pipeline_refusal(engine: EngineSettings) -> Refusal | None:
    """The refusal of settings that ask vLLM for more than one pipeline stage, or None.

    Both ways count: ``engine.pipeline_parallel_size`` and a ``pipeline_parallel_size``
    passed through ``engine.extra_args`` (which vLLM would otherwise refuse with a
    misleading "not supported for this model").
    """
    size = engine.pipeline_parallel_size
    if size > 1:
        return Refusal(
            "engine.pipeline_parallel_size",
            f"pipeline_parallel_size {size} is refused: {PIPELINE_PROBLEM}",
            f"set it to 1 and {PIPELINE_FIX}",
        )
    if "pipeline_parallel_size" in engine.extra_args:
        given = engine.extra_args["pipeline_parallel_size"]
        if str(given).strip() != "1":  # 1, or "1" from HSX_ENGINE__EXTRA_ARGS__..., is a no-op
            return Refusal(
                "engine.extra_args",
                f"pipeline_parallel_size {given!r} is refused: {PIPELINE_PROBLEM}",
                f"remove it and {PIPELINE_FIX}",
            )
    return None


#: vLLM's CPU thread binding: one ``|``-separated CPU list per local rank, in
#: [data-parallel, pipeline, tensor] rank order (vllm/utils/ompmultiprocessing.py).
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binding(ranks: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` CPU workers its own share
    of ``cpus`` (contiguous, the first ranks one more where they do not divide).

    vLLM's own default (``auto``) binds rank N to the N-th NUMA node, and refuses to
    start when there are fewer nodes than ranks ("Not enough allowed NUMA nodes"): the
    usual case on one socket. ValueError when there are fewer CPUs than ranks.
    """
    if len(cpus) < ranks:
        raise ValueError(
            f"{ranks} CPU workers (tensor x data parallel) need at least {ranks} CPUs, "
            f"this process may use {len(cpus)}"
        )
    share, extra = divmod(len(cpus), ranks)
    lists, start = [], 0
    for rank in range(ranks):
        size = share + (1 if rank < extra else 0)
        lists.append(",".join(str(c) for c in cpus[start : start + size]))
        start += size
    return "|".join(lists)
