"""The "writers anywhere" variant of hsx serve, for ``profile_servers --writers-anywhere``.

On this directory's ``PYTHONPATH`` every Python process of ``hsx serve`` runs this at
start-up. Once ``service.engine.writer`` is imported, its ``_off_the_forward_pass``
(private: it keeps the writer's threads off the forward pass's CPU) instead lets them
run on every CPU this process may use, so a wave's tail of writes, when no forward pass
runs, can take both cores. A reach into hsx's private code, for a measurement only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

TARGET = "service.engine.writer"


def _anywhere(_forward_cpus: set[int]) -> None:
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # the cpuset still applies


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            original(module)
            module._off_the_forward_pass = _anywhere

        loader.exec_module = exec_module  # type: ignore[attr-defined]
        return spec


sys.meta_path.insert(0, _Patch())
