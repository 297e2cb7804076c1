"""Provenance without an engine: the weights' SHA-256, its cache, the metadata keys."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

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
from tests.support.processes import wait_until


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
        "ino": shard.stat().st_ino,
        "ctime_ns": shard.stat().st_ctime_ns,
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
    assert read == []  # every file's name, size, mtime, inode and ctime matched the cache
    shard = model / "model-00001-of-00002.safetensors"
    shard.write_bytes(os.urandom(1000))  # same size, new bytes and mtime
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    changed = weights_sha256(model, tmp_path / "fallback")
    assert read == [shard.name]
    assert changed != first
    names = sorted(p.name for p in model.iterdir() if p.suffix in (".bin", ".safetensors"))
    assert changed == expected_sha(model, names)


WEIGHTS = ["extra.bin", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def after_the_clock_moves_past(ctime_ns: int, directory: Path) -> None:
    """Return once a file changed now gets a ctime after ``ctime_ns``: the kernel
    stamps ctimes from a clock that moves in ticks (a few ms)."""
    probe = directory / "clock-probe"

    def ticked() -> bool:
        probe.write_bytes(b"")
        return probe.stat().st_ctime_ns > ctime_ns

    wait_until(ticked, 5, "the file system's clock did not move")


@pytest.mark.parametrize("how", ["in place", "by rename"])
def test_a_same_size_swap_with_its_mtime_restored_is_read_again(
    model: Path, tmp_path: Path, how: str
) -> None:
    # Issue 58, L1: the cache was trusted by name, size and mtime: a weight file
    # swapped for another of the same size, its mtime set back, kept the old hash in
    # /v1/models and in every object. Its inode (by rename) or ctime (in place) differs.
    first = weights_sha256(model, tmp_path / "fallback")
    shard = model / WEIGHTS[1]
    before = shard.stat()
    after_the_clock_moves_past(before.st_ctime_ns, tmp_path)
    if how == "in place":
        with shard.open("r+b") as f:
            f.write(os.urandom(before.st_size))
    else:
        swap = model / "swap.tmp"
        swap.write_bytes(os.urandom(before.st_size))
        swap.replace(shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    swapped = weights_sha256(model, tmp_path / "fallback")
    assert swapped == expected_sha(model, WEIGHTS) != first


def _forge(cache: Path, change: Any) -> None:
    """Rewrite the cache's JSON with ``change`` applied (as an editor would)."""
    data = json.loads(cache.read_text())
    change(data)
    cache.write_text(json.dumps(data))


FORGED = "0" * 64
#: Caches a server must not trust, each made from a good one: it then reads the files.
DOUBTFUL: dict[str, Any] = {
    "writable by others": lambda c: os.chmod(c, 0o666),
    "another version": lambda c: _forge(c, lambda d: d.update(version=1)),
    "not JSON": lambda c: c.write_text("{"),
    "a sha256 that is no hash": lambda c: _forge(
        c, lambda d: d["files"][WEIGHTS[1]].update(sha256="x" * 64)
    ),
    "a size that is a string": lambda c: _forge(
        c, lambda d: d["files"][WEIGHTS[1]].update(size=str(d["files"][WEIGHTS[1]]["size"]))
    ),
    "an entry without ctime": lambda c: _forge(c, lambda d: d["files"][WEIGHTS[1]].pop("ctime_ns")),
    "a symlink": lambda c: (c.rename(c.with_name("elsewhere")), c.symlink_to("elsewhere")),
}


@pytest.mark.parametrize("case", list(DOUBTFUL))
def test_a_cache_in_doubt_is_not_trusted(model: Path, tmp_path: Path, case: str) -> None:
    # Issue 58, L1: an edited cache reported the hash it was edited to hold.
    real = weights_sha256(model, tmp_path / "fallback")
    cache = model / CACHE_NAME
    _forge(cache, lambda d: d["files"][WEIGHTS[1]].update(sha256=FORGED))  # a lie, well formed
    DOUBTFUL[case](cache)
    assert weights_sha256(model, tmp_path / "fallback") == real
    assert json.loads((model / CACHE_NAME).read_text())["files"][WEIGHTS[1]]["sha256"] != FORGED


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_another_users_cache_is_not_trusted(model: Path, tmp_path: Path) -> None:
    real = weights_sha256(model, tmp_path / "fallback")
    cache = model / CACHE_NAME
    _forge(cache, lambda d: d["files"][WEIGHTS[1]].update(sha256=FORGED))
    os.chown(cache, 65534, 65534)
    assert weights_sha256(model, tmp_path / "fallback") == real


def test_an_objects_model_is_its_served_name_never_a_path(tmp_path: Path) -> None:
    # Issue 58, L3: every object's ``model`` was the server's path to the model.
    directory = tmp_path / "srv" / "models" / "tiny-llama"
    directory.mkdir(parents=True)
    meta = object_metadata(str(directory), [1, 2], "float32", {"run": "r1"})
    assert meta["model"] == "tiny-llama"  # what /v1/models answers
    assert not any(str(tmp_path) in value or "/srv/" in value for value in meta.values())
    assert object_metadata("HuggingFaceTB/SmolLM2-135M", [1], "float32")["model"] == (
        "HuggingFaceTB/SmolLM2-135M"  # a hub id is its name
    )


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
