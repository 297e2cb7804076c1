"""The root cause of an engine that failed to start, read from vLLM's log lines.

The real case (a worker that raises while building Qwen3-Next) runs in
tests/e2e/test_model_startup_errors.py; these are the shapes of traceback it does not
produce, in vLLM's prefixed log format.
"""

from __future__ import annotations

from service.engine.root_cause import root_cause, worker_failure

WRAPPED = Exception(
    "WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause."
)


def logged(process: str, *lines: str) -> str:
    """``lines`` as vLLM's logger writes them for ``process``."""
    prefix = f"({process} pid=7) ERROR 12-01 21:53:24 [multiproc_executor.py:953] "
    return "\n".join(prefix + line for line in lines)


def traceback(*lines: str) -> list[str]:
    return ["Traceback (most recent call last):", '  File "x.py", line 1, in f', *lines]


ENGINE_WRAPPER = logged("EngineCore", *traceback("    raise e from None", f"Exception: {WRAPPED}"))


def test_a_chained_worker_error_is_named_by_its_last_exception() -> None:
    log = logged(
        "Worker_TP1",
        *traceback("    load()", "KeyError: 'model.layers.0.w'"),
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        *traceback(
            "    raise ValueError(...) from e", "ValueError: weight model.layers.0.w is missing"
        ),
    )
    text = f"{log}\n{ENGINE_WRAPPER}"
    assert worker_failure(text) == "ValueError: weight model.layers.0.w is missing"
    assert root_cause(WRAPPED, text) == "ValueError: weight model.layers.0.w is missing"


def test_a_bare_assert_names_the_statement() -> None:
    log = logged(
        "Worker",
        *traceback(
            "    assert mixed_qkv.dtype == torch.bfloat16", "    ^^^^^^^^^^", "AssertionError"
        ),
    )
    assert worker_failure(log) == "AssertionError at `assert mixed_qkv.dtype == torch.bfloat16`"


def test_the_first_worker_to_fail_is_the_cause() -> None:
    first = logged("Worker_TP0", *traceback("RuntimeError: out of shared memory"))
    second = logged("Worker_TP1", *traceback("RuntimeError: peer rank 0 is gone"))
    assert worker_failure(f"{first}\n{second}") == "RuntimeError: out of shared memory"


def test_without_a_worker_traceback_the_engine_cores_own_error_is_used() -> None:
    log = logged("EngineCore", *traceback("ValueError: max_model_len 9000 is too long"))
    assert worker_failure(log) is None
    died = RuntimeError("Engine core initialization failed. See root cause above.")
    assert root_cause(died, f"{log}\n{ENGINE_WRAPPER}") == (
        "ValueError: max_model_len 9000 is too long"
    )
    # Nothing logged: the exception's own chain.
    assert root_cause(ValueError("bad\nsecond line"), "") == "ValueError: bad"
