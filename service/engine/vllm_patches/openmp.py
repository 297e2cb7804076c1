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

``OMP_PLACES={a,b,...}`` (one place) binds every thread to all of its CPUs: the
process is bound to them. ``GOMP_CPU_AFFINITY`` and ``KMP_AFFINITY``'s proclist bind
thread i to the i-th CPU: the team is started and each of its threads pinned so. vLLM's
CPU platform preloads torch's GNU OpenMP (``LD_PRELOAD``), so what it writes is
``GOMP_CPU_AFFINITY``.

This re-implements, for the forked process, what vLLM's variables ask of the OpenMP
runtime, so it depends on what vLLM writes (``PATCH``'s fingerprint): where that
changed, the engine processes are spawned as vLLM does it instead of preloaded.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from service.engine.vllm_patches.fingerprints import Digest
from service.engine.vllm_patches.registry import CPU_ONLY, READ, RUN, Kind, TouchPoint

log = logging.getLogger(__name__)

PATCH = TouchPoint(
    name="openmp-settings-after-fork",
    kind=Kind.PERFORMANCE,
    hsx="service/engine/vllm_patches/openmp.py",
    target="re-applies the OpenMP thread count and binding that "
    "vllm.utils.ompmultiprocessing.OMPProcessManager.configure_omp_envs writes",
    why="a worker forked from the preloaded server loaded OpenMP before vLLM set its "
    "variables: unapplied, TP=2 on two cores ran four unbound threads",
    platforms=CPU_ONLY,
    checked_on={"0.32.0": RUN, "0.33.0": READ},
    fingerprints=(
        Digest(
            "vllm.utils.ompmultiprocessing:OMPProcessManager.configure_omp_envs",
            {"0.32.0": "e809ad160b7ca7e3", "0.33.0": "e809ad160b7ca7e3"},
        ),
    ),
)

#: Above any CPU number Linux gives (its CPU_SETSIZE is 1024 by default, 8192 at most
#: in practice): a larger one is a typo, not a set of that size to build.
MAX_CPUS = 1 << 16

_PLACE = re.compile(r"\{([^}]*)\}")
_PROCLIST = re.compile(r"proclist=\[([^\]]*)\]")


def take_openmp_settings(environ: Mapping[str, str]) -> None:
    """Bind this process to the CPUs ``environ`` names for OpenMP, then size torch's
    OpenMP pool to its ``OMP_NUM_THREADS``, in that order (threads the pool starts
    inherit the binding); where the variable lists CPUs thread by thread
    (``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``'s proclist), start the pool and pin its
    threads one CPU each, as the runtime would. Nothing for what is absent or not
    understood."""
    cpus = bound_cpus(environ) if hasattr(os, "sched_setaffinity") else None
    # A binding the kernel refuses is ignored, as the runtime ignores it; the thread
    # count still applies.
    bound = bool(cpus) and _set_affinity(0, cpus or set())
    threads = thread_count(environ)
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)  # also starts torch's pthreadpool, not OpenMP's team
    order = per_thread_cpus(environ)
    if bound and order and threads > 1:
        _pin_team(torch, threads, order)


def _set_affinity(task: int, cpus: set[int]) -> bool:
    try:
        os.sched_setaffinity(task, cpus)
    except OSError as exc:  # none of them allowed here (cpuset), or the task is gone
        log.warning("hsx: OpenMP binding to CPUs %s not applied: %s", sorted(cpus), exc)
        return False
    return True


def _pin_team(torch: Any, threads: int, order: list[int]) -> None:
    """Start the OpenMP team (one parallel region over ``threads`` chunks), then pin
    its threads (the ones the region started) in the order they were started, the main
    thread first, to ``order``'s CPUs in turn, wrapping as GNU OpenMP does when there
    are more threads than CPUs. Other threads (torch's pthreadpool) keep the process's
    binding, as they would under the runtime."""
    before = set(os.listdir("/proc/self/task"))
    torch.ones(threads * (1 << 16)).add_(1)  # above at::parallel_for's grain per thread
    team = sorted(int(task) for task in set(os.listdir("/proc/self/task")) - before)
    for index, task in enumerate([os.getpid(), *team]):
        _set_affinity(task, {order[index % len(order)]})


def thread_count(environ: Mapping[str, str]) -> int | None:
    """The outermost level of ``OMP_NUM_THREADS`` ("4" or "4,2"), or None."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not re.fullmatch(r"[0-9]{1,6}", first) or int(first) == 0:
        return None
    return int(first)


def per_thread_cpus(environ: Mapping[str, str]) -> list[int] | None:
    """The CPUs of ``KMP_AFFINITY``'s proclist or ``GOMP_CPU_AFFINITY`` in thread order
    (thread i on the i-th), or None: ``OMP_PLACES`` binds every thread to its place."""
    text = _per_thread_list(environ)
    return None if text is None else _cpu_sequence(text)


def _per_thread_list(environ: Mapping[str, str]) -> str | None:
    """The text of the thread-by-thread CPU list vLLM wrote (``""`` for a proclist this
    cannot read), or None when it wrote none."""
    kmp = environ.get("KMP_AFFINITY", "")
    if "proclist=" in kmp:
        found = _PROCLIST.search(kmp)
        return found.group(1).replace("{", "").replace("}", "") if found else ""
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    return gomp or None


def bound_cpus(environ: Mapping[str, str]) -> set[int] | None:
    """The CPUs vLLM's binding variables name (the one its executor wrote), or None.

    Understands what vLLM writes and the plain forms around it: ``KMP_AFFINITY``'s
    ``proclist=[0,2-3]``, ``GOMP_CPU_AFFINITY``'s ``"0 1 4-7:2"`` and ``OMP_PLACES``'s
    ``{0,1},{2,3}`` (with ``OMP_PROC_BIND`` not ``false``); abstract places
    (``cores``) are left to the runtime."""
    listed = _per_thread_list(environ)
    if listed is not None:  # one not understood: no binding at all
        return parse_cpus(listed)
    bind = environ.get("OMP_PROC_BIND", "").strip().lower()
    places = _PLACE.findall(environ.get("OMP_PLACES", ""))
    if places and bind not in ("", "false"):
        return parse_cpus(",".join(places))
    return None


def parse_cpus(text: str) -> set[int] | None:
    """``"0 1,4-7:2"`` -> {0, 1, 4, 6}; None when any part is not a CPU number or range,
    or when there is none."""
    sequence = _cpu_sequence(text)
    return set(sequence) if sequence else None


def _cpu_sequence(text: str) -> list[int] | None:
    """``"1 0,4-7:2"`` -> [1, 0, 4, 6], in the order given; None as ``parse_cpus``."""
    cpus: list[int] = []
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
        cpus.extend(range(start, end + 1, step))
    return cpus or None
