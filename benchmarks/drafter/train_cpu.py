"""``speculators train`` on a machine without an accelerator: three patches, then its CLI.

``python -m benchmarks.drafter.train_cpu <speculators train flags>`` is
``speculators train <flags>`` with the three changes below applied in this process
before speculators' own typer app starts; the model, data loader, loss and trainer are
speculators' own code, unchanged (checked with speculators 0.9.0; the drafter rows'
notes in ``docs/benchmarks.md`` describe the whole run). Each patch replaces a helper
that assumes a CUDA-like device with one that answers "cpu"; none changes what is
computed.

Train in float32 end to end (``--hidden-states-dtype float32``): the trainer asks for
autocast on device type ``cuda`` when no accelerator exists, and on a CPU that
autocast disables itself with a warning, so bfloat16 would not be used anyway.
"""

from __future__ import annotations

import sys


def apply_cpu_patches() -> None:
    """Make speculators' trainer run on the CPU (no-ops where an accelerator exists)."""
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    # 1. The trainer moves every batch with ``tensor.to(get_local_rank())``; the rank is
    #    the int 0, which ``.to()`` reads as ``cuda:0`` and fails with "Cannot access
    #    accelerator device when none is available". On a CPU the batch stays put.
    trainer.get_local_rank = lambda: "cpu"  # type: ignore[assignment,return-value]
    # 2. The step timer calls ``torch.accelerator.synchronize()`` on every logged step
    #    to time GPU work; without an accelerator it raises the same error. CPU work is
    #    synchronous already, so there is nothing to wait for.
    torch.accelerator.synchronize = lambda device=None: None  # type: ignore[assignment]
    # 3. Resuming from a checkpoint loads its state onto ``get_current_device()``, which
    #    answers ``"cuda:0"`` when no accelerator exists. The bench never resumes (every
    #    arm trains into a new directory); the patch keeps a re-run of a killed arm
    #    from failing the same way.
    checkpointer.get_current_device = lambda: "cpu"  # type: ignore[assignment]


def _report_peak_rss() -> None:
    """The bench reads this line from the log: the process's peak RSS in MiB."""
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"hsx-bench peak_rss_mib={peak_kib // 1024}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Apply the patches, then run ``speculators train`` with ``argv`` (default: ours)."""
    import atexit

    apply_cpu_patches()
    atexit.register(_report_peak_rss)
    from speculators.cli import app

    args = sys.argv[1:] if argv is None else argv
    app(["train", *args], prog_name="speculators")


if __name__ == "__main__":
    main()
