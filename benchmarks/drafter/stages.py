"""The drafter bench's torch stages, each in a process of its own, importing once.

``python -m benchmarks.drafter.stages`` imports torch, transformers and speculators
(about 8 CPU-seconds on this machine, most of what a short training run costs), then
reads jobs from stdin, one JSON line each (``{"module": ..., "args": [...], "log":
...}``), and runs each job in a child forked from itself: the child is ``python -m
module args`` as a fresh interpreter would run it (its own stdout and stderr, both
into ``log``, its own exit status, its atexit handlers, its memory given back when it
exits), only without importing those libraries again. After each job it answers one
line, ``{"exit": status}``. The bench's reference forward, its four training runs and
its scoring are such jobs (``benchmarks.drafter_bench.Stages``).

Forking is safe here because this process only imports: no torch op runs in it, so
no OpenMP pool exists to be lost in a child, and the threads that imports leave (one
of torch's, pyarrow's jemalloc background thread) are ones those libraries re-create
after a fork (vLLM's preloaded engine fork server relies on the same).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys
import traceback

#: What every stage imports; a module missing from the environment is left out.
PRELOAD = (
    "torch",
    "safetensors.torch",
    "transformers",
    "datasets",
    "speculators.cli",
    "speculators.train.trainer",
    "speculators.train.checkpointer",
    "speculators.train.data",
    "speculators.models.eagle3",
)


def _exit_code(code: object) -> int:
    """What a process exiting with ``SystemExit(code)`` reports."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_job(module: str, args: list[str], log: str) -> int:
    """In the forked child: run ``module`` as ``__main__`` with ``args``, its output in
    ``log``; its exit status."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)  # the job list is the parent's, not the job's
    os.close(quiet)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as an interpreter's exit would (train_cpu reports its peak)
    return code


def main() -> None:
    """Import, say so, then fork one child per job line on stdin, one at a time."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # the job that needs it fails with the error itself
            continue
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_job(job["module"], list(job["args"]), job["log"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # never the parent's loop or exit handlers
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
