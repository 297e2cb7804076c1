"""Reading vLLM's OpenMP variables (``service.engine.vllm_patches.openmp``): what each runtime's
form names, and nothing for what is absent or not understood."""

from __future__ import annotations

import pytest

from service.engine.vllm_patches.openmp import bound_cpus, per_thread_cpus, thread_count


@pytest.mark.parametrize(
    ("environ", "cpus"),
    [
        ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),  # what vLLM writes
        ({"OMP_PLACES": "{0,1},{4,5}", "OMP_PROC_BIND": "close"}, {0, 1, 4, 5}),
        ({"OMP_PLACES": "{3}", "OMP_PROC_BIND": "false"}, None),  # binding off
        ({"OMP_PLACES": "{3}"}, None),  # no OMP_PROC_BIND: places alone do not bind
        ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),  # left to the runtime
        ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),  # vLLM, GNU OpenMP preloaded
        ({"GOMP_CPU_AFFINITY": "0-3 8,10 12-16:2"}, {0, 1, 2, 3, 8, 10, 12, 14, 16}),
        ({"GOMP_CPU_AFFINITY": "3-1"}, None),
        ({"GOMP_CPU_AFFINITY": "0 x"}, None),
        ({"GOMP_CPU_AFFINITY": "   "}, None),
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[5,6,7]"}, {5, 6, 7}),
        ({"KMP_AFFINITY": "explicit,proclist=[{0,1},3-4]"}, {0, 1, 3, 4}),
        ({"KMP_AFFINITY": "compact"}, None),
        ({"KMP_AFFINITY": "proclist=[1]", "GOMP_CPU_AFFINITY": "0"}, {1}),
        ({"OMP_PLACES": "{" + "9" * 400 + "-}", "OMP_PROC_BIND": "true"}, None),
        ({"GOMP_CPU_AFFINITY": "0-99999"}, None),  # no set of 100,000 CPUs is built
        ({"GOMP_CPU_AFFINITY": "٣"}, None),  # a digit to Python, not to OpenMP
        ({}, None),
    ],
)
def test_bound_cpus_reads_each_runtimes_form(
    environ: dict[str, str], cpus: set[int] | None
) -> None:
    assert bound_cpus(environ) == cpus


@pytest.mark.parametrize(
    ("value", "threads"),
    [
        ("4", 4),
        ("4,2", 4),
        (" 2 ", 2),
        ("0", None),
        ("-1", None),
        ("two", None),
        ("", None),
        ("٣", None),
        ("9" * 400, None),
    ],
)
def test_thread_count_reads_the_outermost_level(value: str, threads: int | None) -> None:
    assert thread_count({"OMP_NUM_THREADS": value}) == threads


@pytest.mark.parametrize(
    ("environ", "order"),
    [
        ({"GOMP_CPU_AFFINITY": "3 1 2"}, [3, 1, 2]),  # thread i on the i-th, as given
        ({"GOMP_CPU_AFFINITY": "0-6:3"}, [0, 3, 6]),
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,0]"}, [2, 0]),
        ({"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "true"}, None),  # places, not threads
        ({"GOMP_CPU_AFFINITY": "0 -1"}, None),
    ],
)
def test_per_thread_cpus_keeps_the_order_given(
    environ: dict[str, str], order: list[int] | None
) -> None:
    assert per_thread_cpus(environ) == order
