"""Why hsx refuses vLLM's sleep mode, in the words start-up and the builder both use.

Sleep mode frees the KV cache (or remaps its memory) while the engine sleeps and
restores it on wake. hsx's connector holds the hidden-state cache tensor it copies from
and pinned host buffers it copies into, and its writer may still be copying a request
out; it cannot follow the cache away and back, so its ``supports_sleep_mode`` answers
False. vLLM 0.33 asks that question when ``enable_sleep_mode`` is set; vLLM 0.32 does
not, so hsx refuses the setting itself, before any engine starts.
"""

from __future__ import annotations

from service.config import EngineSettings
from service.engine.parallel import Refusal

SLEEP_MODE_PROBLEM = (
    "enable_sleep_mode is refused: sleep would free or remap the KV cache under hsx's "
    "connector, which holds its hidden-state tensor and pinned copy buffers (its "
    "supports_sleep_mode is False)"
)


def sleep_mode_refusal(engine: EngineSettings) -> Refusal | None:
    """The refusal of settings that ask vLLM for sleep mode, or None. Only
    ``engine.extra_args`` can ask (``enable_sleep_mode``); "false", 0 and the like,
    as an ``HSX_ENGINE__EXTRA_ARGS__...`` variable gives them, do not."""
    given = engine.extra_args.get("enable_sleep_mode", False)
    if str(given).strip().lower() in ("false", "0", "", "none", "no", "off"):
        return None
    return Refusal("engine.extra_args", SLEEP_MODE_PROBLEM, "remove enable_sleep_mode from it")
