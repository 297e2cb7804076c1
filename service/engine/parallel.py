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
