"""Helpers of the drafter bench (``benchmarks/drafter_bench.py``): seed questions, the
CPU launcher of ``speculators train``, the reference forward and the held-out scoring."""
