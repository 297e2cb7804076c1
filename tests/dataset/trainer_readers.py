"""The trainers' own reader code, from their released wheels, for the export tests.

Neither wheel is a dependency of hsx, and neither can be installed into its venv:
SpecForge 0.2.0 pins sglang 0.5.14 and torch 2.11 (hsx runs torch 2.13), and ModelOpt
0.47.0's package ``__init__`` imports its whole quantization toolkit and ``omegaconf``.
So each wheel is fetched once per machine with ``pip download --no-deps`` into
``var/trainers/`` (as the demo model is: ``service/demo_model.py``), unpacked there, and
its reader modules are run from the wheel's own source files, unchanged:

- SpecForge: the unpacked wheel on ``sys.path``; its offline reader, normalisers,
  collators, feature store and vocabulary counter import without sglang (they use torch
  only).
- ModelOpt: the parent packages are registered without running their ``__init__``
  (an empty module whose ``__path__`` is the wheel's directory), so importing
  ``modelopt.torch.speculative.eagle.utils`` runs that file and what it imports
  (``modelopt.torch.utils.loss_mask``), nothing else.

Where neither a wheel nor the package index is at hand, the tests that need them skip,
saying so.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

#: Where the wheels are kept, beside the demo model (``var/`` is not tracked).
CACHE = Path(__file__).resolve().parents[2] / "var" / "trainers"
WHEELS = {"specforge": ("specforge", "0.2.0"), "modelopt": ("nvidia_modelopt", "0.47.0")}
#: ModelOpt's packages whose ``__init__`` is skipped (module docstring).
MODELOPT_PACKAGES = (
    "modelopt",
    "modelopt.torch",
    "modelopt.torch.utils",
    "modelopt.torch.speculative",
    "modelopt.torch.speculative.eagle",
)


def unpacked(which: str) -> Path:
    """The unpacked wheel of ``which`` (``specforge``, ``modelopt``); skips the test
    when it cannot be downloaded."""
    dist, version = WHEELS[which]
    target = CACHE / f"{dist}-{version}"
    if (target / ".complete").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"{dist}-{version}-*.whl"))
    if not wheels:
        requirement = f"{dist.replace('_', '-')}=={version}"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-d", str(CACHE), requirement],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        wheels = sorted(CACHE.glob(f"{dist}-{version}-*.whl"))
        if not wheels:
            pytest.skip(f"cannot download {requirement}: {done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as archive:
        archive.extractall(target)
    (target / ".complete").write_text("")
    return target


def specforge() -> types.SimpleNamespace:
    """SpecForge 0.2.0's offline data plane: reader, normalisers, collators, loader."""
    root = str(unpacked("specforge"))
    if root not in sys.path:
        sys.path.insert(0, root)
    eagle3 = importlib.import_module("specforge.algorithms.eagle3.data")
    dflash = importlib.import_module("specforge.algorithms.common.dflash_family_data")
    return types.SimpleNamespace(
        eagle3=eagle3,
        dflash=dflash,
        store=importlib.import_module("specforge.runtime.data_plane.feature_store"),
        loader=importlib.import_module("specforge.runtime.data_plane.feature_dataloader"),
        vocab=importlib.import_module("specforge.training.vocab_mapping"),
    )


def specforge_batches(path: Path, strategy: str, max_len: int = 256) -> dict[str, Any]:
    """Every sample under ``path`` as SpecForge's offline training loop gets it: its
    strategy's reader, the feature store's lazy file reads, its normaliser and
    collator, one sample a batch. {the file's path: the batch's tensors}."""
    sf = specforge()
    if strategy == "eagle3":
        reader = sf.eagle3.build_offline_reader(
            str(path), run_id="hsx", ttt_length=7, max_len=max_len
        )
        normalise, collate = (
            sf.eagle3.build_offline_normalizer(max_len),
            sf.eagle3.build_offline_collator(),
        )
    else:
        reader = sf.dflash.build_offline_reader(
            strategy, str(path), run_id="hsx", ttt_length=7, max_len=max_len
        )
        normalise, collate = sf.dflash.build_offline_normalizer(max_len), sf.dflash.build_collator()
    refs = reader.read()
    loader = sf.loader.FeatureDataLoader(
        sf.store.LocalFeatureStore(), refs=refs, batch_size=1, collate_fn=collate,
        per_sample_transform=normalise, drop_last=False, strategy=strategy, gc_interval_s=None,
    )  # fmt: skip
    by_id = {ref.sample_id: ref.feature_store_uri.removeprefix("file://") for ref in refs}
    return {by_id[batch.sample_ids[0]]: batch.tensors for batch in loader}


def modelopt() -> types.SimpleNamespace:
    """ModelOpt 0.47.0's offline dataset and collator, and its vocabulary calibration."""
    root = unpacked("modelopt")
    for name in MODELOPT_PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root / name.replace(".", "/"))]
            sys.modules[name] = package
    return types.SimpleNamespace(
        eagle=importlib.import_module("modelopt.torch.speculative.eagle.utils"),
        utils=importlib.import_module("modelopt.torch.speculative.utils"),
    )


def modelopt_samples(path: Path) -> dict[str, dict[str, Any]]:
    """Every ``.pt`` under ``path`` (ModelOpt's training script globs them recursively)
    through its ``OfflineSupervisedDataset`` with answer-only loss: {path: item}."""
    files = sorted(str(p) for p in path.rglob("*.pt"))
    dataset = modelopt().eagle.OfflineSupervisedDataset(files, answer_only_loss=True)
    return {files[i]: dataset[i] for i in range(len(dataset))}
