"""Server-made keys and namespace validation."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from service.storage import InvalidKeyError
from service.storage.keys import (
    idempotent_key,
    is_idempotent_key,
    namespace_of,
    new_object_key,
    validate_key,
    validate_key_prefix,
    validate_namespace,
)


def test_key_layout() -> None:
    when = datetime(2026, 3, 7, 23, 59, tzinfo=UTC)
    key = new_object_key("hsx", "team-a", now=when)
    assert re.fullmatch(r"hsx/team-a/2026/03/07/[0-9a-f]{32}\.safetensors", key)


def test_keys_are_unique() -> None:
    keys = {new_object_key("hsx", "a") for _ in range(1000)}
    assert len(keys) == 1000


def test_empty_prefix_and_nested_prefix() -> None:
    assert new_object_key("", "a").startswith("a/")
    assert new_object_key("x/y", "a").startswith("x/y/a/")


@pytest.mark.parametrize("namespace", ["", "A", "-a", "a-", "a/b", "..", "a.b", "x" * 65, "é"])
def test_bad_namespaces_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        validate_namespace(namespace)
    with pytest.raises(ValueError, match="namespace"):
        new_object_key("hsx", namespace)


@pytest.mark.parametrize("namespace", ["a", "team-a", "t_1", "x" * 64])
def test_good_namespaces(namespace: str) -> None:
    assert validate_namespace(namespace) == namespace


@pytest.mark.parametrize(
    "key", ["a" * 256, "a/" * 600 + "a", "a b", "a:b", "a%2fb", "é", "~user", "a\nb"]
)
def test_validate_key_refuses(key: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(key)


def test_namespace_of() -> None:
    key = new_object_key("hsx", "team-a")
    assert namespace_of(key, "hsx") == "team-a"
    assert namespace_of(key, "other") is None
    assert namespace_of("hsx/team-a/2026/01/01", "hsx") is None
    assert namespace_of("hsx/../team-a/2026/01/01/x.safetensors", "hsx") is None
    assert namespace_of(new_object_key("", "b"), "") == "b"


IDENTITY = {"custom_id": "row-17", "model": "m", "layer_ids": [2, 4], "dtype": "float32"}


def test_idempotent_keys_are_deterministic_and_dateless() -> None:
    key = idempotent_key("hsx", "team-a", **IDENTITY)
    assert key == idempotent_key("hsx", "team-a", **IDENTITY)
    assert re.fullmatch(r"hsx/team-a/by-id/([0-9a-f]{2})/\1[0-9a-f]{62}\.safetensors", key)
    assert namespace_of(key, "hsx") == "team-a"
    assert is_idempotent_key(key)
    assert not is_idempotent_key(new_object_key("hsx", "team-a"))


@pytest.mark.parametrize(
    "change",
    [{"custom_id": "row-18"}, {"model": "other"}, {"layer_ids": [2, 3]}, {"dtype": "bfloat16"}],
)
def test_idempotent_keys_change_with_every_input(change: dict[str, object]) -> None:
    # The namespace and the served model, and the custom_id within them: what a request
    # sends (token ids, codec, loss, ...) is checked against the stored object instead
    # (issue 26, finding 8), so one custom_id has one key.
    base = idempotent_key("hsx", "team-a", **IDENTITY)
    assert idempotent_key("hsx", "team-a", **{**IDENTITY, **change}) != base
    assert idempotent_key("hsx", "team-b", **IDENTITY) != base


def test_no_client_string_reaches_the_key() -> None:
    hostile = {**IDENTITY, "custom_id": "../../etc/passwd\x00"}
    key = idempotent_key("hsx", "team-a", **hostile)
    assert "etc" not in key
    assert validate_key(key) == key


@pytest.mark.parametrize("prefix", ["", "hsx/", "hsx/team-a/", "hsx/team-a/2026/0", "hsx/te"])
def test_good_key_prefixes(prefix: str) -> None:
    assert validate_key_prefix(prefix) == prefix


@pytest.mark.parametrize("prefix", ["/hsx", "hsx//", "../", "hsx/../x/", "hsx/.", "a b", "é/"])
def test_bad_key_prefixes(prefix: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key_prefix(prefix)
