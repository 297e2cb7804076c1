"""Transparent huge pages for the engine's large CPU tensors (torch's ``THP_MEM_ALLOC_ENABLE``).

On a CPU host the forward pass streams every weight matrix, the KV cache and its
activations through the TLB each step; with 4 KiB pages a 2048-token step of a small
model touches tens of thousands of pages. With ``THP_MEM_ALLOC_ENABLE=1`` torch's CPU
allocator advises each allocation of 2 MiB or more (``madvise(MADV_HUGEPAGE)``), so
the kernel backs its whole 2 MiB-aligned stretches with 2 MiB pages wherever
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (most distributions'
default) or ``always``; under ``never`` it changes nothing. vLLM's CPU build leaves it
unset. Measured on the 2-core test machine (docs/cpu.md, "Huge pages"): a stock engine
12-16% faster over 64 prompts of 256 tokens, hsx's extraction 10% at one prompt in
flight and 18% at eight.

torch reads the variable once per process, at its first CPU allocation, and every
process inherits it from its parent's environment at start. So it must be in the
environment before the process that computes allocates anything: ``hsx serve`` sets it
before it imports torch (the engine's fork server is forked from the serving process),
and :meth:`service.engine.extractor.Extractor.start` before it starts the engine's
processes (a fork server launched fresh, or vLLM's own spawned processes). A value the
operator set is kept either way.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: torch's switch (c10's ``alloc_cpu``): "1" advises allocations of 2 MiB and more.
VARIABLE = "THP_MEM_ALLOC_ENABLE"


def ask_for_huge_pages(enabled: bool, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set torch's huge-page switch in ``environ`` for the processes started from now on
    (and for this one, if it has allocated no tensor yet), unless it is set already: the
    operator's value wins over ``enabled`` (``engine.cpu_huge_pages``). Returns whether
    the environment now asks for huge pages."""
    environ.setdefault(VARIABLE, "1" if enabled else "0")
    return environ[VARIABLE] == "1"


def system_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``: the
    bracketed word of ``path``), or None where the kernel has none."""
    try:
        with open(path, encoding="ascii") as file:
            text = file.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
