"""The metrics wrapper reports what each storage operation did, wherever it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from service.config import StorageSettings
from service.metrics import StorageMetrics
from service.storage import NotFoundError, StorageOp, open_storage
from service.storage.instrumented import InstrumentedStorage
from tests.storage.contract import fresh_key


async def test_metrics_follow_operations(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    storage = open_storage(StorageSettings(url=str(tmp_path)), StorageMetrics(registry, "file"))
    assert isinstance(storage, InstrumentedStorage)  # every backend, one place

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"backend": "file", **labels})

    keys = [fresh_key() for _ in range(3)]
    for i, key in enumerate(keys):
        await storage.put(key, b"x" * (100 * (i + 1)))
    await storage.get(keys[0])
    reader = await storage.open_read(keys[2])
    assert b"".join([piece async for piece in reader.chunks]) == b"x" * 300
    with pytest.raises(NotFoundError):
        await storage.head(fresh_key())
    with pytest.raises(NotFoundError):
        await storage.open_read(fresh_key())
    assert await storage.exists(keys[1])
    listed = await storage.list("hsx/", limit=2)
    assert [o.key for o in listed.objects] == sorted(keys)[:2]
    await storage.delete(keys[1])

    assert value("hsx_storage_written_bytes_total") == 600
    assert value("hsx_storage_read_bytes_total") == 400  # get 100 + streamed 300
    assert value("hsx_storage_operation_duration_seconds_count", operation="put") == 3
    assert value("hsx_storage_operation_duration_seconds_count", operation="get") == 3
    assert value("hsx_storage_operation_duration_seconds_count", operation="head") == 1
    assert value("hsx_storage_operation_duration_seconds_count", operation="exists") == 1
    assert value("hsx_storage_operation_duration_seconds_count", operation="list") == 1
    assert value("hsx_storage_errors_total", operation="head", kind="not_found") == 1
    assert value("hsx_storage_errors_total", operation="get", kind="not_found") == 1
    assert (
        value("hsx_storage_errors_total", operation="put", kind="not_found") == 0
    )  # pre-registered, never counted
    assert value("hsx_storage_retries_total") == 0
    await storage.close()


async def test_ops_reach_any_observer_as_plain_data(tmp_path: Path) -> None:
    """The worker's observer only collects ops; they must say everything on their own."""
    seen: list[StorageOp] = []

    class Collect:
        def observe(self, op: StorageOp) -> None:
            seen.append(op)

    storage = open_storage(StorageSettings(url=str(tmp_path)), Collect())
    key = fresh_key()
    ref = await storage.put(key, b"abc")
    with pytest.raises(NotFoundError):
        await storage.get(fresh_key())
    await storage.close()
    assert [(o.backend, o.operation, o.written, o.error) for o in seen] == [
        ("file", "put", ref.size, None),
        ("file", "get", 0, "not_found"),
    ]
    assert all(o.seconds >= 0 and o.retries == 0 for o in seen)


def test_two_metric_sets_cannot_share_a_registry() -> None:
    registry = CollectorRegistry()
    StorageMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        StorageMetrics(registry)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gs.*not supported.*file://, mooncake://, s3://"):
        open_storage(StorageSettings(url="gs://bucket/x"))


def test_every_error_kind_is_pre_registered() -> None:
    from service.metrics import ERROR_KINDS
    from service.storage import base

    kinds = {
        cls.kind
        for cls in vars(base).values()
        if isinstance(cls, type) and issubclass(cls, base.StorageError)
    }
    assert kinds == set(ERROR_KINDS)
