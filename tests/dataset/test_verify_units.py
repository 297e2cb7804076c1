"""verify's pieces without a server: parity's sample and bounds, token drift's diff,
the provenance of an object's header, and the command line's checks."""

from __future__ import annotations

import pytest

from service.dataset.drift import differs
from service.dataset.manifest import Record
from service.dataset.objects import provenance_of
from service.dataset.parity import ParityError, Sampled, bound_for, compare, sample
from service.dataset.store import RunStore


def candidates(count: int) -> list[Sampled]:
    store = RunStore("/nonexistent-run")
    return [
        Sampled(store, None, Record(row=i, custom_id=f"r{i}", status="ok", num_tokens=i * 10))  # type: ignore[arg-type]
        for i in range(count)
    ]


def test_the_sample_is_spread_over_lengths_and_fixed_by_its_seed() -> None:
    pool = candidates(100)
    picked = sample(pool, 8, seed=3)
    rows = sorted(s.record.row for s in picked)
    assert [row // 13 for row in rows] == list(range(8))  # one per eighth of the lengths
    assert [s.record.row for s in sample(pool, 8, seed=3)] == [s.record.row for s in picked]
    assert [s.record.row for s in sample(pool, 8, seed=4)] != [s.record.row for s in picked]
    assert len(sample(pool[:5], 8, seed=0)) == 5  # fewer rows than K: all of them


def test_bounds_by_dtype_and_codec() -> None:
    assert bound_for("float32", "raw") == 1e-3
    assert bound_for("bfloat16", "fp8") == pytest.approx(5e-2 + 3e-2)
    assert bound_for("float32", "bf16") == pytest.approx(1e-3 + 2**-9)
    with pytest.raises(ParityError, match="codec 'zip'"):
        bound_for("float32", "zip")


def test_compare_fails_a_zero_layer_and_passes_rounding() -> None:
    import torch

    reference = torch.randn(6, 2, 16, dtype=torch.float64)
    stored = reference * (1 + 1e-7)
    stored[:, 1] = 0
    first, second = compare(stored, reference, [3, 7], bound=1e-4)
    assert (first.layer, first.ok) == (3, True)
    assert (second.layer, second.ok, second.relative_error, second.cosine) == (7, False, 1.0, 0.0)


def test_token_drift_diff() -> None:
    assert differs([1, 2, 3], [1, 2, 3], with_outputs=False) is None
    assert differs([1, 2, 3, 9], [1, 2, 3], with_outputs=True) is None  # an output token
    found = differs([1, 2, 4, 5], [1, 2, 3], with_outputs=False)
    assert found is not None
    assert found.endswith("stored token ids (4) differ from the chat template's render (3) "
                          "from position 2")  # fmt: skip


def test_provenance_comes_from_the_header() -> None:
    import torch
    from safetensors.torch import save

    data = save(
        {"hidden_states": torch.zeros(1, 1, 2)},
        metadata={"hsx.codec": "raw", "hsx.provenance.weights_sha256": "ab", "dtype": "float32"},
    )
    assert provenance_of(data) == {"weights_sha256": "ab"}
    assert provenance_of(save({"x": torch.zeros(1)})) == {}
