"""``benchmarks.common.Preforked``: each job is a process of its own, forked from one that
imported its libraries, and reports as ``python -m`` would (no engine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import psutil
import pytest

from benchmarks.common import Preforked

JOB = "tests.bench.preforked_job"


def _seen(output: str) -> dict[str, object]:
    found: dict[str, object] = json.loads(output.splitlines()[0])
    return found


def test_each_job_is_a_child_of_the_preloaded_process_with_its_own_output(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[list[str], int]:
        async with Preforked.start(("decimal",), tmp_path / "runner.log") as runner:
            outputs = [
                await runner.run(JOB, "ok", str(i), log=tmp_path / f"job{i}.log") for i in range(2)
            ]
            runner_pid = runner.pid
        return outputs, runner_pid

    outputs, runner_pid = asyncio.run(scenario())
    first, second = (_seen(out) for out in outputs)
    assert first["argv"] == ["ok", "0"]
    assert second["argv"] == ["ok", "1"]
    assert first["ppid"] == second["ppid"] == runner_pid  # forked from the runner ...
    assert first["pid"] != second["pid"]  # ... a process per job
    assert first["preloaded"] is True  # what the runner imported, the job has
    assert first["name"] == "__main__"  # run as `python -m` runs it
    for i, out in enumerate(outputs):
        assert (tmp_path / f"job{i}.log").read_text() == out
        assert "to stderr" in out  # stdout and stderr both in the job's log
        assert out.rstrip().endswith("atexit ran")  # its exit handlers ran
    assert not psutil.pid_exists(runner_pid) or psutil.Process(runner_pid).status() == "zombie"


@pytest.mark.parametrize(
    ("args", "status", "text"),
    [(("exit", "3"), 3, "atexit ran"), (("raise",), 1, "ValueError: the job failed")],
)
def test_a_failed_job_raises_with_its_status_and_output(
    tmp_path: Path, args: tuple[str, ...], status: int, text: str
) -> None:
    async def scenario() -> str:
        async with Preforked.start(("decimal",), tmp_path / "runner.log") as runner:
            with pytest.raises(RuntimeError) as failed:
                await runner.run(JOB, *args, log=tmp_path / "job.log")
            return str(failed.value) + "\n" + await runner.run(JOB, "ok", log=tmp_path / "ok.log")

    message = asyncio.run(scenario())
    assert f"python -m {JOB} failed ({status})" in message
    assert text in message
    assert '"argv": ["ok"]' in message  # the runner serves the next job


def test_a_job_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, str]:
        async with Preforked.start(("decimal",), tmp_path / "runner.log") as runner:
            with pytest.raises(TimeoutError):
                await runner.run(JOB, "sleep", "60", log=tmp_path / "slow.log", timeout_s=2)
            slow = int(str(_seen((tmp_path / "slow.log").read_text())["pid"]))
            return slow, await runner.run(JOB, "ok", log=tmp_path / "ok.log")

    slow, after = asyncio.run(scenario())
    assert not psutil.pid_exists(slow)  # killed and reaped
    assert _seen(after)["argv"] == ["ok"]


def test_a_runner_that_cannot_import_says_so(tmp_path: Path) -> None:
    """A preload that fails is left to the job that needs it; a runner that dies is an
    error naming its log's tail."""

    async def scenario() -> str:
        async with Preforked.start(("no_such_module_here",), tmp_path / "r.log") as runner:
            return await runner.run(JOB, "ok", log=tmp_path / "job.log")

    assert _seen(asyncio.run(scenario()))["argv"] == ["ok"]
