"""Every touch point hsx has with vLLM (and CPython, and OpenMP), patches first.

``PATCHES`` are what hsx installs; ``TOUCH_POINTS`` adds what it only reads, builds on
or sets. ``check_patches`` is ``hsx serve``'s start-up check of every patch this host
would install, before any engine starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.engine.vllm_patches import (
    cpu_mamba,
    drafts,
    forkserver,
    mamba_padding,
    mp_context,
    openmp,
    polling,
)
from service.engine.vllm_patches.registry import TouchPoint, applies
from service.engine.vllm_patches.touchpoints import READ_ONLY

if TYPE_CHECKING:
    from service.config import EngineSettings

PATCHES: tuple[TouchPoint, ...] = (
    drafts.PATCH,
    mp_context.PATCH,
    forkserver.PATCH,
    openmp.PATCH,
    polling.PAUSE,
    polling.SPIN_THEN_PAUSE,
    cpu_mamba.PATCH,
    mamba_padding.PATCH,
)
TOUCH_POINTS: tuple[TouchPoint, ...] = PATCHES + READ_ONLY


def in_use(engine: EngineSettings) -> tuple[TouchPoint, ...]:
    """The patches an engine of these settings would install, where they apply: the
    preloaded processes' only with ``preload_engine_processes``, the queue polling's
    only with a pause (and a spin) to make."""
    used = [drafts.PATCH, cpu_mamba.PATCH, mamba_padding.PATCH]
    if engine.preload_engine_processes:
        used.append(mp_context.PATCH)
        if engine.cpu_poll_interval_us > 0:
            used.append(polling.PAUSE)
            if engine.cpu_poll_spin_us > 0:
                used.append(polling.SPIN_THEN_PAUSE)
    return tuple(used)


def check_patches(engine: EngineSettings) -> dict[str, bool]:
    """Whether each patch ``engine`` would use applies on this host
    (``registry.applies``): a performance patch whose target changed is left off with
    one warning line; a correctness one raises ``PatchTargetChanged``. What is learnt
    goes with the engine processes (``registry.snapshot``)."""
    return {patch.name: applies(patch) for patch in in_use(engine)}
