"""A job for ``tests/bench/test_preforked.py``: ``python -m tests.bench.preforked_job
ACTION [ARG]`` reports what it sees, then does ACTION (``ok``, ``exit N``, ``raise``,
``sleep S``)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time


def main() -> None:
    action, *rest = sys.argv[1:]
    atexit.register(print, "atexit ran", flush=True)
    seen = {
        "argv": sys.argv[1:],
        "ppid": os.getppid(),
        "pid": os.getpid(),
        "preloaded": "decimal" in sys.modules,
        "name": __name__,
    }
    print(json.dumps(seen), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if action == "exit":
        sys.exit(int(rest[0]))
    if action == "raise":
        raise ValueError("the job failed")
    if action == "sleep":
        time.sleep(float(rest[0]))


if __name__ == "__main__":
    main()
