"""Settings: environment variables, nesting, and refusal of unsafe values."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import Settings


def test_defaults_are_safe() -> None:
    settings = Settings()
    assert settings.server.host == "127.0.0.1"
    assert settings.storage.create_only is True
    assert settings.storage.s3.retry_mode == "standard"


def test_nested_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_STORAGE__URL", "s3://bucket/prefix")
    monkeypatch.setenv("HSX_STORAGE__S3__REGION", "eu-west-1")
    monkeypatch.setenv("HSX_STORAGE__S3__PART_SIZE", str(8 * 1024 * 1024))
    monkeypatch.setenv("HSX_ENGINE__LAYER_IDS", "[2, 4, 6]")
    monkeypatch.setenv("HSX_SERVER__PORT", "9000")
    settings = Settings()
    assert settings.storage.url == "s3://bucket/prefix"
    assert settings.storage.s3.region == "eu-west-1"
    assert settings.storage.s3.part_size == 8 * 1024 * 1024
    assert settings.engine.layer_ids == [2, 4, 6]
    assert settings.server.port == 9000


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"storage": {"s3": {"part_size": 1024}}}, "part_size"),
        ({"storage": {"s3": {"max_attempts": 0}}}, "max_attempts"),
        ({"storage": {"key_prefix": "../etc"}}, "key_prefix"),
        ({"engine": {"layer_ids": [1, 1]}}, "layer_ids"),
        ({"engine": {"layer_ids": []}}, "layer_ids"),
        ({"engine": {"layer_ids": [-1]}}, "layer_ids"),
        ({"server": {"port": 70000}}, "port"),
        ({"server": {"host": "a b"}}, "host"),
        ({"storage": {"s3": {"checksum_algorithm": "MD5"}}}, "checksum_algorithm"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_unsafe_values_are_refused_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(**overrides)
