"""The metrics wrapper records what each storage operation did."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from service.config import StorageSettings
from service.metrics import StorageMetrics
from service.storage import NotFoundError, open_storage
from tests.storage.contract import fresh_key


async def test_metrics_follow_operations(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    storage = open_storage(StorageSettings(url=str(tmp_path)), StorageMetrics(registry))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"backend": "file", **labels})

    keys = [fresh_key() for _ in range(3)]
    for i, key in enumerate(keys):
        await storage.put(key, b"x" * (100 * (i + 1)))
    await storage.get(keys[0])
    with pytest.raises(NotFoundError):
        await storage.head(fresh_key())
    await storage.delete(keys[1])

    assert value("hsx_storage_written_bytes_total") == 600
    assert value("hsx_storage_read_bytes_total") == 100
    assert value("hsx_storage_operation_duration_seconds_count", operation="put") == 3
    assert value("hsx_storage_operation_duration_seconds_count", operation="head") == 1
    assert value("hsx_storage_errors_total", operation="head", kind="not_found") == 1
    assert value("hsx_storage_errors_total", operation="put", kind="not_found") is None
    assert value("hsx_storage_retries_total") == 0
    await storage.close()
    assert value("hsx_storage_retries_total") is None


def test_two_metric_sets_cannot_share_a_registry() -> None:
    registry = CollectorRegistry()
    StorageMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        StorageMetrics(registry)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gs.*not supported.*file://, s3://"):
        open_storage(StorageSettings(url="gs://bucket/x"))
