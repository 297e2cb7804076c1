"""A bench's child processes, each forked from one process that imported their libraries.

``python -m benchmarks.preforked MODULE...`` imports each MODULE (vLLM costs about 8
CPU-seconds to import on this machine, torch with transformers and speculators as much),
then reads jobs from stdin, one JSON line each (``{"module": ..., "args": [...], "log":
...}``), and runs each in a child forked from itself: the child is ``python -m module
args`` as a fresh interpreter would run it (stdout and stderr both into ``log``, its own
exit status and atexit handlers, its memory given back when it exits), only without
importing those libraries again. It answers ``{"ready": true}`` once imported, and for
each job ``{"pid": ...}`` when the child starts and ``{"exit": ...}`` when it ends.
``benchmarks.common.Preforked`` drives it; jobs run one at a time.

Forking is safe because this process only imports: no torch op runs in it, so no
OpenMP pool exists to be lost in a child, and the threads imports leave (one of
torch's, pyarrow's jemalloc background thread) are ones their libraries re-create after
a fork, as in vLLM's preloaded engine fork server (``service/engine/prestart.py``). A
child is single-threaded when it starts, so a bench child may fork its own engine fork
server from itself (``benchmarks.common.fork_engine_server``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys
import traceback


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


def _answer(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    """Import the modules named on the command line, then fork one child per job line
    on stdin, one at a time."""
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except ImportError:  # the job that needs it fails with the error itself
            continue
    _answer(ready=True)
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
        _answer(pid=pid)
        _, status = os.waitpid(pid, 0)
        _answer(exit=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
