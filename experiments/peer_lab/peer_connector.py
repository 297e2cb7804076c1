"""vLLM's ``ExampleHiddenStatesConnector`` on a CPU-only machine, for the peer lab.

The class is the as-shipped bench's (:mod:`benchmarks.cpu_connector`, which says what
it replaces: only the stock connector's CUDA calls); vLLM loads it from here by module
path (``kv_connector_module_path``). :func:`wait_for_file` is how the lab's client
counts a request done.
"""

from __future__ import annotations

import fcntl

from benchmarks.cpu_connector import CpuHiddenStatesConnector

__all__ = ["CpuHiddenStatesConnector", "wait_for_file"]


def wait_for_file(path: str) -> None:
    """Block until the connector has written ``path`` (its lock released), as vLLM's
    ``load_hidden_states`` does, without reading the file."""
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
