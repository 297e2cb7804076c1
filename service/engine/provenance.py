"""What made the stored states: versions, the model's weights and template, the layer ids.

A run of training data can only be reproduced (or its silent corruption traced) if each
object says what produced it: a different vLLM, torch or checkpoint changes the states
without changing any shape. :class:`Provenance` is built once per start-up in the API
process, before the engine's arguments are (``builder.prepare``, ``hsx serve``), travels to the
EngineCore in ``wire.ConnectorConfig`` and is written into every object's
``__metadata__`` as ``hsx.provenance.<field>`` strings (``objects.object_metadata``; the
keys are reserved), and shown by ``/v1/models`` as ``ModelCard.provenance``.

The weights' SHA-256 reads every weight file once: seconds per GB. It is cached per
file in ``<model>/.hsx-weights-sha256.json``, or under ``var/cache/`` when the model's
directory is read-only, so a restart re-reads only files that changed.

What the cache may be trusted with (issue 58, L1): a file's entry is used only while
its name, size, mtime, inode and ctime all match. Size and mtime alone let a weight
swapped for another of the same size, its mtime restored (``touch -d``, ``cp -p``,
``rsync -t``), report the old hash; a swap by rename gets another inode, an edit in
place a new ctime, which no user can set back (a copy of the directory gets both, and
is read once more). The cache file itself is read only when it is a regular file owned
by the server's user (or root) and writable by no one else, its version is this one,
and each entry has the form this module writes; on any doubt the files are read again
and the cache rewritten. What is left: the server's own user (or root) can write a
cache that lies, as it can change the weights or hsx itself; the hash says what the
server read, not that nobody with its rights lied.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

import service

log = logging.getLogger(__name__)

#: Prefix of the provenance keys in an object's ``__metadata__``.
METADATA_PREFIX = "hsx.provenance."
#: hsx's layer ids, in the words of docs/design.md ("Object format").
LAYER_CONVENTION = (
    "hidden_states[:, j] holds layer id layer_ids[j]; layer id i is the input of decoder "
    "layer i (0 = the embeddings); id num_hidden_layers is the last layer's output before "
    "the final norm"
)
#: The files whose bytes are the weights (top level of the model's directory).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
CACHE_NAME = ".hsx-weights-sha256.json"
#: The cache's layout; a cache of another version is read as none (1: no inode, ctime).
CACHE_VERSION = 2
#: What must match for a file's cached hash to be used (module doc).
IDENTITY = ("size", "mtime_ns", "ino", "ctime_ns")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Where the weights' cache goes when the model's directory is read-only.
FALLBACK_CACHE_DIR = Path("var/cache/hsx")
_CHUNK = 8 * 1024 * 1024


class Provenance(BaseModel):
    """What made a server's states, fixed for its lifetime. None: not known here (a
    model given by hub id has no local weights before vLLM downloads them; a package
    installed from a wheel has no git commit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hsx_version: str
    hsx_commit: str | None = None
    vllm_version: str
    torch_version: str
    model_revision: str | None = None
    """The checkpoint's revision: Hugging Face's commit hash, or ``revision`` in its config."""
    weights_sha256: str | None = None
    """SHA-256 of ``sha256sum``'s lines (``<sha256>  <name>\\n``) over the weight files,
    sorted by name: see :func:`weights_sha256`."""
    layer_convention: str = LAYER_CONVENTION
    chat_template_sha256: str | None = None

    def fields(self, codec: str | None = None, dtype: str | None = None) -> dict[str, str]:
        """The known fields as strings, by name; ``codec`` and ``dtype`` (per object and
        known only once the engine runs) beside them when given."""
        known = {k: v for k, v in self.model_dump().items() if v is not None}
        extra = {"codec": codec, "dtype": dtype}
        return {**known, **{k: v for k, v in extra.items() if v is not None}}

    def metadata(self, codec: str | None = None, dtype: str | None = None) -> dict[str, str]:
        """:meth:`fields` under their ``__metadata__`` keys (``hsx.provenance.<name>``)."""
        return {METADATA_PREFIX + k: v for k, v in self.fields(codec, dtype).items()}


def build_provenance(model: str, revision: str | None = None, tokenizer: Any = None) -> Provenance:
    """The provenance of a server for ``model`` (a directory or a hub id).

    ``revision``: the checkpoint's, from its config (``builder.ModelInfo.revision``).
    ``tokenizer``: the model's Hugging Face tokenizer, when the caller has one; else the
    chat template is read with transformers' ``AutoTokenizer``, as vLLM reads it.
    """
    import torch
    import vllm

    path = Path(model)
    return Provenance(
        hsx_version=service.__version__,
        hsx_commit=git_commit(Path(service.__file__).resolve().parent.parent),
        vllm_version=str(vllm.__version__),
        torch_version=str(torch.__version__),
        model_revision=revision,
        weights_sha256=weights_sha256(path) if path.is_dir() else None,
        chat_template_sha256=template_sha256(_chat_template(model, tokenizer)),
    )


def template_sha256(template: str | None) -> str | None:
    """SHA-256 of a chat template's text; None for no template."""
    return hashlib.sha256(template.encode()).hexdigest() if template else None


def _chat_template(model: str, tokenizer: Any) -> str | None:
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except Exception as exc:  # a model without a tokenizer of its own
            log.warning("hsx: no tokenizer for %s (%s): no chat template hash", model, exc)
            return None
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def git_commit(root: Path) -> str | None:
    """``git rev-parse HEAD`` of ``root`` when it is a git checkout, else None."""
    git = shutil.which("git")
    if git is None or not (root / ".git").exists():
        return None
    try:
        # A fixed command on our own checkout: nothing a caller sent reaches it.
        done = subprocess.run(  # noqa: S603
            [git, "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a model's directory (top level), sorted by name."""
    return sorted(
        p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    )


def weights_sha256(model_dir: Path, fallback_dir: Path = FALLBACK_CACHE_DIR) -> str | None:
    """SHA-256 of the weights of ``model_dir``: of the lines ``sha256sum`` prints for its
    weight files in name order (``sha256sum *.safetensors | sha256sum`` for a model of
    safetensors only). None when it has no weight files.

    A file whose name, size, mtime, inode and ctime are in the cache is not read
    again; the cache is ``<model_dir>/.hsx-weights-sha256.json``, else one per model
    under ``fallback_dir``, else none (every start reads the weights). A cache not to
    be trusted is read as none (module doc).
    """
    files = weight_files(model_dir)
    if not files:
        return None
    start = time.perf_counter()
    caches = [model_dir / CACHE_NAME, fallback_dir / f"{_path_id(model_dir)}.json"]
    cached = next((found for c in caches if (found := _read_cache(c)) is not None), {})
    entries, read = {}, 0
    for file in files:
        identity = _identity(file.stat())  # before the read: a change during it shows next time
        entry = cached.get(file.name)
        if entry is None or {k: entry[k] for k in IDENTITY} != identity:
            entry = {**identity, "sha256": _file_sha(file)}
            read += identity["size"]
        entries[file.name] = entry
    if read or entries != cached:
        _write_cache(caches, entries)
    digest = _manifest_sha((entries[f.name]["sha256"], f.name) for f in files)
    log.info(
        "hsx: weights SHA-256 of %d file(s) in %.2f s (%.1f MB read, the rest cached)",
        len(files),
        time.perf_counter() - start,
        read / 1e6,
    )
    return digest


def _identity(info: os.stat_result) -> dict[str, Any]:
    """What a cache entry must match for its hash to be used (``IDENTITY``)."""
    return {
        "size": info.st_size,
        "mtime_ns": info.st_mtime_ns,
        "ino": info.st_ino,
        "ctime_ns": info.st_ctime_ns,
    }


def _manifest_sha(lines: Iterable[tuple[str, str]]) -> str:
    """SHA-256 of ``sha256sum``'s output for (sha256, name) pairs."""
    return hashlib.sha256("".join(f"{sha}  {name}\n" for sha, name in lines).encode()).hexdigest()


def _file_sha(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _path_id(model_dir: Path) -> str:
    # One cache file per model directory in the shared fallback directory.
    return hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:32]


def _read_cache(path: Path) -> dict[str, dict[str, Any]] | None:
    """The well-formed entries of the cache at ``path``; None when there is none to
    trust: missing, not a regular file, another user's or writable by others, of
    another version or not JSON. A malformed entry is left out (its file is read)."""
    try:
        # Not a link's target, and a FIFO put there must not block the start.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        # Root's too, as sshd trusts its files: an image built as root may hold the cache.
        if info.st_uid not in (os.getuid(), 0) or info.st_mode & 0o022:
            log.warning("hsx: not trusting %s (another user's, or writable by others)", path)
            return None
        data = json.loads(os.read(fd, info.st_size + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("version") != CACHE_VERSION:
        return None
    return {name: entry for name, entry in files.items() if _well_formed(entry)}


def _well_formed(entry: Any) -> bool:
    """Whether a cache entry has exactly the form ``weights_sha256`` writes."""
    if not isinstance(entry, dict) or set(entry) != {*IDENTITY, "sha256"}:
        return False
    numbers = [entry[k] for k in IDENTITY]
    if not all(type(n) is int and n >= 0 for n in numbers):  # bool is no size
        return False
    return isinstance(entry["sha256"], str) and _SHA256.fullmatch(entry["sha256"]) is not None


def _write_cache(paths: list[Path], entries: dict[str, dict[str, Any]]) -> None:
    """Write the cache to the first of ``paths`` that takes it (atomically: a reader
    never sees half a file); none: the hashes live only in this process."""
    text = json.dumps({"version": CACHE_VERSION, "files": entries}, indent=1, sort_keys=True)
    for path in paths:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".hsx-tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users
                os.replace(tmp, path)
                return
            except OSError:
                os.unlink(tmp)
                raise
    log.warning("hsx: cannot cache the weights' SHA-256 (%s read-only)", paths[0].parent)
