"""Whole datasets through hsx: ``hsx dataset run``, ``verify`` and ``export``.

The Python API mirrors the commands (``run_dataset``, ``estimate_dataset``,
``verify_dataset``, ``export_speculators``)::

    from service.dataset import RunOptions, run_dataset

    summary = run_dataset(RunOptions(input="chats.jsonl", endpoints=["http://hsx:8000"],
                                     output="s3://bucket/runs/chats", loss="assistant"))

A run keeps all its state in its output (``job.json``, the manifest, ``errors.jsonl``,
``summary.json``); running the same options again resumes it. The objects stay in the
server's storage; the manifest names their keys.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from service.dataset.manifest import Summary
from service.dataset.options import RunOptions

if TYPE_CHECKING:  # httpx and the rest load with the functions that use them
    from service.dataset.estimate import Estimate
    from service.dataset.verify import Checks, VerifyReport

__all__ = [
    "RunOptions",
    "Summary",
    "estimate_dataset",
    "export_speculators",
    "run_dataset",
    "verify_dataset",
]


def run_dataset(options: RunOptions) -> Summary:
    """Run or resume a dataset run; blocks until it is done or stopped."""
    from service.dataset.session import run_dataset_async

    return asyncio.run(run_dataset_async(options))


def estimate_dataset(options: RunOptions, sample: int = 64) -> Estimate:
    """Projected tokens, bytes and time of a run, from a tokenised sample; writes nothing."""
    from service.dataset.estimate import estimate_async

    return asyncio.run(estimate_async(options, sample))


def verify_dataset(
    output: str, endpoint: str, api_key: str | None = None, checks: Checks | None = None
) -> VerifyReport:
    """Check every object a run's manifest names; ``checks`` adds parity against
    transformers, token drift and the provenance policy (``service.dataset.verify``)."""
    from service.dataset.verify import verify_async

    return asyncio.run(verify_async(output, endpoint, api_key, checks=checks))


def export_speculators(
    output: str,
    dest: str | Path,
    endpoint: str,
    api_key: str | None = None,
    allow_partial: bool = False,
) -> int:
    """Write the speculators training layout of a run into ``dest``; the sample count.

    A run with undecided rows is refused (``ExportError``) unless ``allow_partial``.
    """
    from service.dataset.export import export_speculators_async

    return asyncio.run(
        export_speculators_async(output, dest, endpoint, api_key, allow_partial=allow_partial)
    )
