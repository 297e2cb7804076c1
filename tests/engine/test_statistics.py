"""Per-object statistics and the token-norm gauge, without an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.client.models import LayerStatistics
from service.engine import statistics
from service.engine.metrics import TOKEN_NORM_WEIGHT, ExtractorMetrics
from service.engine.statistics import layer_statistics
from service.engine.wire import Completion, StoredObject
from service.storage.base import StorageOp


def numpy_statistics(states: np.ndarray) -> dict[str, list[float]]:
    """The reference: every field from numpy, in float64, over finite values."""
    x = states.astype(np.float64)
    finite = np.isfinite(x)
    x = np.where(finite, x, 0.0)
    norms = np.sqrt((x * x).sum(axis=2))  # [tokens, layers]
    return {
        "sum": x.sum(axis=(0, 2)).tolist(),
        "sum_sq": (x * x).sum(axis=(0, 2)).tolist(),
        "sum_abs": np.abs(x).sum(axis=(0, 2)).tolist(),
        "max_abs": np.abs(x).max(axis=(0, 2)).tolist(),
        "sum_token_norm": norms.sum(axis=0).tolist(),
        "zero_rows": (np.abs(x).max(axis=2) == 0).sum(axis=0).tolist(),
        "non_finite": (~finite).sum(axis=(0, 2)).tolist(),
    }


def assert_matches(stats: LayerStatistics, states: np.ndarray, rtol: float = 1e-9) -> None:
    expected = numpy_statistics(states)
    assert (stats.num_tokens, stats.hidden_size) == (states.shape[0], states.shape[2])
    for name, values in expected.items():
        np.testing.assert_allclose(getattr(stats, name), values, rtol=rtol, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_statistics_equal_numpys(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statistics, "CHUNK_VALUES", 3 * 3 * 16)  # several chunks
    generator = torch.Generator().manual_seed(0)
    states = (torch.randn(37, 3, 16, generator=generator) * 4).to(dtype)
    states[5] = 0  # an all-zero token row in every layer
    states[9, 1] = 0  # and one in layer position 1 only
    stats = layer_statistics(states)
    assert stats.zero_rows == [1, 2, 1]
    assert_matches(stats, states.float().numpy())


def test_non_finite_values_are_counted_and_left_out() -> None:
    states = torch.ones(4, 2, 3)
    states[0, 0, 0] = float("nan")
    states[1, 1, 2] = float("inf")
    stats = layer_statistics(states)
    assert stats.non_finite == [1, 1]
    assert stats.max_abs == [1.0, 1.0]
    assert_matches(stats, states.numpy())


def test_empty_object() -> None:
    stats = layer_statistics(torch.zeros(0, 2, 4))
    assert stats.num_tokens == 0
    assert stats.sum == [0.0, 0.0]


def stored(layer_ids: tuple[int, ...], states: torch.Tensor) -> StoredObject:
    return StoredObject(
        key="hsx/ns/2026/01/01/" + "a" * 32 + ".safetensors",
        uri="file:///x",
        size=1,
        sha256="s",
        num_tokens=states.shape[0],
        shape=tuple(states.shape),
        layer_ids=layer_ids,
        statistics=layer_statistics(states),
    )


def test_gauge_is_the_moving_average_of_the_objects_token_norms() -> None:
    metrics = ExtractorMetrics("file")
    metrics.name_model("tiny", (2, 4))
    generator = torch.Generator().manual_seed(1)
    objects = [torch.randn(n, 2, 8, generator=generator) * (i + 1) for i, n in enumerate((5, 9, 3))]
    expected: dict[int, float] = {}
    for states in objects:
        obj = stored((2, 4), states)
        completion = Completion(key=obj.key, stored=obj)
        metrics.record(Completion.decode(completion.encode()))  # as it crosses the channel
        norms = states.double().norm(dim=2).mean(dim=0).tolist()
        for layer, norm in zip((2, 4), norms, strict=True):
            old = expected.get(layer)
            expected[layer] = norm if old is None else old + TOKEN_NORM_WEIGHT * (norm - old)
    for layer, value in expected.items():
        sample = metrics.registry.get_sample_value(
            "hsx_hidden_state_token_norm", {"model": "tiny", "layer": str(layer)}
        )
        assert sample == pytest.approx(value, rel=1e-12)


def series(metrics: ExtractorMetrics) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in metrics.registry.collect()
        for sample in family.samples
    }


def test_label_values_come_from_closed_sets_whatever_a_message_says() -> None:
    metrics = ExtractorMetrics("file")
    metrics.name_model("tiny", (2, 4))
    states = torch.ones(3, 2, 8)
    obj = stored((2, 4), states)
    metrics.record(Completion(key=obj.key, stored=obj))
    before = series(metrics)
    odd = stored((999998, 999999), states * 1e30)
    ops = tuple(
        StorageOp(backend, operation, 0.1, written=1, error=error)
        for backend, operation, error in [
            ("evil", "put", None), ("file", "steal", None), ("file", "put", "novel"),
        ]
    )  # fmt: skip
    metrics.record(Completion(key=odd.key, stored=odd, storage_ops=ops))
    assert series(metrics) == before  # no new series
    assert metrics.registry.get_sample_value(
        "hsx_hidden_state_token_norm", {"model": "tiny", "layer": "4"}
    ) == pytest.approx(8**0.5)  # the served layers keep their values
    assert (
        metrics.registry.get_sample_value("hsx_storage_written_bytes_total", {"backend": "file"})
        == 0.0
    )
