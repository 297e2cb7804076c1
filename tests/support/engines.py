"""Engine settings for tests that start a real vLLM engine (in process or served)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.config import Settings


def engine_settings(model: Path, storage_url: str, **overrides: Any) -> Settings:
    """Small engine settings for the CPU: chunked prefill forced by a 64-token budget.

    ``overrides`` are Settings fields; ``engine=`` and ``storage=`` dicts are merged
    into these defaults rather than replacing them.
    """
    engine = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 64,
        "gpu_memory_utilization": 0.5,
        "cpu_kvcache_space_gib": 1,
        "extra_args": {"enforce_eager": True},
        **overrides.pop("engine", {}),
    }
    return Settings(
        engine=engine, storage={"url": storage_url, **overrides.pop("storage", {})}, **overrides
    )
