"""Provenance without an engine: the weights' SHA-256, its cache, the metadata keys."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.engine import provenance
from service.engine.objects import is_reserved, object_metadata, reserved_keys
from service.engine.provenance import (
    CACHE_NAME,
    LAYER_CONVENTION,
    METADATA_PREFIX,
    Provenance,
    build_provenance,
    weights_sha256,
)


def expected_sha(directory: Path, names: list[str]) -> str:
    """``sha256sum <names in order> | sha256sum``, with hashlib."""
    lines = "".join(
        f"{hashlib.sha256((directory / n).read_bytes()).hexdigest()}  {n}\n" for n in names
    )
    return hashlib.sha256(lines.encode()).hexdigest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model-00002-of-00002.safetensors").write_bytes(os.urandom(3 << 20))
    (directory / "model-00001-of-00002.safetensors").write_bytes(os.urandom(1000))
    (directory / "extra.bin").write_bytes(b"bin")
    (directory / "config.json").write_text("{}")  # not a weight file
    return directory


def test_hash_is_sha256sum_of_the_weight_files_by_name(model: Path, tmp_path: Path) -> None:
    names = ["extra.bin", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weights_sha256(model, tmp_path / "fallback") == expected_sha(model, names)
    cache = json.loads((model / CACHE_NAME).read_text())
    assert sorted(cache["files"]) == names
    shard = model / names[2]
    assert cache["files"][names[2]] == {
        "size": shard.stat().st_size,
        "mtime_ns": shard.stat().st_mtime_ns,
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }


def test_cache_hit_reads_nothing_and_a_changed_file_is_read_again(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = weights_sha256(model, tmp_path / "fallback")
    read: list[str] = []
    real = provenance._file_sha
    monkeypatch.setattr(provenance, "_file_sha", lambda p: read.append(p.name) or real(p))
    assert weights_sha256(model, tmp_path / "fallback") == first
    assert read == []  # every file's name, size and mtime matched the cache
    shard = model / "model-00001-of-00002.safetensors"
    shard.write_bytes(os.urandom(1000))  # same size, new bytes and mtime
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    changed = weights_sha256(model, tmp_path / "fallback")
    assert read == [shard.name]
    assert changed != first
    names = sorted(p.name for p in model.iterdir() if p.suffix in (".bin", ".safetensors"))
    assert changed == expected_sha(model, names)


def test_unwritable_cache_goes_under_the_fallback(model: Path, tmp_path: Path) -> None:
    fallback = tmp_path / "var-cache"
    # A directory where the cache file would go: writing it fails as on a read-only
    # model directory, even for root (whom chmod does not stop).
    (model / CACHE_NAME).mkdir()
    digest = weights_sha256(model, fallback)
    assert not any((model / CACHE_NAME).iterdir())
    (cached,) = fallback.glob("*.json")
    assert sorted(json.loads(cached.read_text())["files"]) == sorted(
        p.name for p in model.iterdir() if p.suffix in (".bin", ".safetensors")
    )
    assert weights_sha256(model, fallback) == digest


def test_no_weight_files_no_hash(tmp_path: Path) -> None:
    assert weights_sha256(tmp_path) is None


def test_build_provenance_of_a_tiny_model(model_dir: object) -> None:
    import torch
    import vllm

    import service

    directory = model_dir("llama")  # type: ignore[operator]
    built = build_provenance(str(directory), "abc123")
    weights = sorted(p.name for p in directory.glob("*.safetensors"))
    assert built.weights_sha256 == expected_sha(directory, weights)
    assert built.hsx_version == service.__version__
    assert built.vllm_version == vllm.__version__
    assert built.torch_version == torch.__version__
    assert built.model_revision == "abc123"
    assert built.layer_convention == LAYER_CONVENTION
    template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    if template is None:
        template = (directory / "chat_template.jinja").read_text()
    assert built.chat_template_sha256 == hashlib.sha256(template.encode()).hexdigest()
    # Frozen: one value for the server's lifetime.
    with pytest.raises(ValidationError, match="frozen"):
        built.hsx_version = "x"  # type: ignore[misc]


def test_metadata_keys_are_reserved_and_win_over_the_callers() -> None:
    origin = Provenance(hsx_version="1", vllm_version="2", torch_version="3", weights_sha256="w")
    fields = origin.metadata("fp8", "bfloat16")
    assert fields == {
        METADATA_PREFIX + "hsx_version": "1",
        METADATA_PREFIX + "vllm_version": "2",
        METADATA_PREFIX + "torch_version": "3",
        METADATA_PREFIX + "weights_sha256": "w",
        METADATA_PREFIX + "layer_convention": LAYER_CONVENTION,
        METADATA_PREFIX + "codec": "fp8",
        METADATA_PREFIX + "dtype": "bfloat16",
    }
    # A key this server does not know (hsx_commit) is reserved all the same.
    caller = {"hsx.provenance.weights_sha256": "forged", "hsx.provenance.hsx_commit": "x", "a": "b"}
    assert reserved_keys(caller) == ["hsx.provenance.hsx_commit", "hsx.provenance.weights_sha256"]
    assert not is_reserved("a")
    meta = object_metadata("m", [1, 2], "bfloat16", caller, fields)
    assert meta["hsx.provenance.weights_sha256"] == "w"
    assert "hsx.provenance.hsx_commit" not in meta
    assert meta["a"] == "b"
