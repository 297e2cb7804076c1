"""Apply vLLM's OpenMP thread count and CPU binding in a process forked after the
OpenMP runtime was loaded.

vLLM's CPU executor tells each worker how many OpenMP threads to run and where, as
environment variables set just before it starts the worker
(``vllm/utils/ompmultiprocessing.py``): ``OMP_NUM_THREADS``, and one of
``KMP_AFFINITY`` (Intel OpenMP preloaded), ``GOMP_CPU_AFFINITY`` (GNU OpenMP preloaded)
or ``OMP_PLACES`` with ``OMP_PROC_BIND=true`` (neither). The runtime reads them once,
when it is loaded. A worker forked from hsx's preloaded server
(``service.engine.prestart``) loaded it in the server, before they were set, so it
would run one thread per CPU of the server's affinity, unbound: TP=2 on two cores ran
four threads on both cores instead of one on each. ``take_openmp_settings`` does in the
forked process what the runtime would have done at load, before any parallel region.

The binding is applied per process (the union of the CPUs named): exactly what vLLM
asks for with ``OMP_PLACES={a,b,...}`` (one place, every thread bound to all of it),
and the CPUs, not the thread-by-thread order, of a ``GOMP_CPU_AFFINITY`` or
``KMP_AFFINITY`` list.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: Above any CPU number Linux gives (its CPU_SETSIZE is 1024 by default, 8192 at most
#: in practice): a larger one is a typo, not a set of that size to build.
MAX_CPUS = 1 << 16

_PLACE = re.compile(r"\{([^}]*)\}")
_PROCLIST = re.compile(r"proclist=\[([^\]]*)\]")


def take_openmp_settings(environ: Mapping[str, str]) -> None:
    """Bind this process to the CPUs ``environ`` names for OpenMP, then size torch's
    OpenMP pool to its ``OMP_NUM_THREADS``, in that order (threads the pool starts
    inherit the binding). Nothing for a variable that is absent or not understood."""
    cpus = bound_cpus(environ)
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:  # none of them allowed here: the runtime would ignore it
            log.warning("hsx: OpenMP binding to CPUs %s not applied: %s", sorted(cpus), exc)
    threads = thread_count(environ)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def thread_count(environ: Mapping[str, str]) -> int | None:
    """The outermost level of ``OMP_NUM_THREADS`` ("4" or "4,2"), or None."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not re.fullmatch(r"[0-9]{1,6}", first) or int(first) == 0:
        return None
    return int(first)


def bound_cpus(environ: Mapping[str, str]) -> set[int] | None:
    """The CPUs vLLM's binding variables name (the one its executor wrote), or None.

    Understands what vLLM writes and the plain forms around it: ``KMP_AFFINITY``'s
    ``proclist=[0,2-3]``, ``GOMP_CPU_AFFINITY``'s ``"0 1 4-7:2"`` and ``OMP_PLACES``'s
    ``{0,1},{2,3}`` (with ``OMP_PROC_BIND`` not ``false``); abstract places
    (``cores``) are left to the runtime."""
    kmp = _PROCLIST.search(environ.get("KMP_AFFINITY", ""))
    if kmp:
        return _cpu_list(kmp.group(1).replace("{", "").replace("}", ""))
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    if gomp:
        return _cpu_list(gomp)
    bind = environ.get("OMP_PROC_BIND", "").strip().lower()
    places = _PLACE.findall(environ.get("OMP_PLACES", ""))
    if places and bind not in ("", "false"):
        return _cpu_list(",".join(places))
    return None


def _cpu_list(text: str) -> set[int] | None:
    """``"0 1,4-7:2"`` -> {0, 1, 4, 6}; None when any part is not a CPU number or range."""
    cpus: set[int] = set()
    for part in re.split(r"[\s,]+", text.strip()):
        if not part:
            continue
        match = re.fullmatch(r"([0-9]{1,5})(?:-([0-9]{1,5})(?::([0-9]{1,5}))?)?", part)
        if match is None:
            return None
        start = int(match.group(1))
        end = int(match.group(2) or start)
        step = int(match.group(3) or 1)
        if end < start or step < 1 or end >= MAX_CPUS:
            return None
        cpus.update(range(start, end + 1, step))
    return cpus or None
