"""The per-row error helpers of ``benchmarks.real_model_bench`` (no engine)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.real_model_bench import row_errors, summarize


def test_row_errors_are_per_row_relative_error_and_cosine() -> None:
    reference = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])  # [T=1, L=2, H=2]
    approx = torch.tensor([[[3.0, 4.5], [0.0, 1.0]]])

    relative, cosine = row_errors(reference, approx)

    assert relative.shape == cosine.shape == (1, 2)
    assert relative[0, 0].item() == pytest.approx(0.5 / 5.0)
    assert relative[0, 1].item() == pytest.approx(math.sqrt(2.0))
    assert cosine[0, 0].item() == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)))
    assert cosine[0, 1].item() == pytest.approx(0.0)


def test_row_errors_compare_in_float32() -> None:
    """bfloat16 states against a float8 decode: upcast, no float8 ops (unsupported on CPU)."""
    reference = torch.randn(4, 3, 64).to(torch.bfloat16)
    approx = reference.to(torch.float8_e4m3fn)

    relative, cosine = row_errors(reference, approx)

    assert relative.dtype == cosine.dtype == torch.float32
    assert 0 < relative.max().item() < 0.07  # float8's 3 mantissa bits: at most 2**-4
    assert cosine.min().item() > 0.99


def test_exact_and_zero_rows() -> None:
    reference = torch.zeros(2, 1, 8)
    reference[0, 0, 3] = 2.0

    relative, cosine = row_errors(reference, reference.clone())

    assert relative.tolist() == [[0.0], [0.0]]
    assert cosine[0, 0].item() == pytest.approx(1.0)
    assert cosine[1, 0].item() == 0.0  # a zero row has no direction


def test_summarize_takes_medians_and_worst_rows() -> None:
    relative = torch.tensor([[0.01, 0.03], [0.02, 0.015]])
    cosine = torch.tensor([[0.9999, 0.9990], [0.9998, 0.9997]])

    summary = summarize(relative, cosine)

    assert summary.rows == 4
    assert summary.relative_median == pytest.approx(0.0175)
    assert summary.relative_worst == pytest.approx(0.03)
    assert summary.cosine_median == pytest.approx(0.99975)
    assert summary.cosine_worst == pytest.approx(0.9990)
