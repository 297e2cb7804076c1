"""``hsx dataset export`` in every trainer layout, read back by each trainer's own reader
code, against a transformers float32 forward at the layout's layers and norm side.

One server per model for the module (the tiny random-weight Llama, 4 layers, the real
SmolLM2 demo model, 30 layers, and a tiny Gemma 3, 4 layers, whose final norm is
``1 + weight``), each making one chat run with loss masks on the assistant turns (4, 2
and 2 rows). SpecForge's and ModelOpt's readers come from their released wheels
(``tests/dataset/trainer_readers.py`` says how and why). EAGLE's reader is its
training script (``eagle/train/main.py``, which trains at import); its
``CustomDataset`` loads each file with ``torch.load`` and reads ``hidden_state``,
``input_ids`` and ``loss_mask``, as ``read_eagle`` does here.

A test that changes objects rewrites them in storage (with manifest lines that match,
in its own copy of the run) and restores them (``served_runs.tampered``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.dataset.final_norm import load_final_norm
from service.engine.tiny_models import make_model
from tests.dataset.export_checks import (
    aux_reference,
    before_norm,
    chat_run,
    close,
    export,
    forward,
    lengths,
    manifest,
)
from tests.dataset.served_runs import ServedRun, load_object, served_env, tampered
from tests.dataset.trainer_readers import modelopt_samples, specforge_batches
from tests.support.processes import hsx_serve, link_demo_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_dir: Any) -> Iterator[ServedRun]:
    root = tmp_path_factory.mktemp("export-tiny")
    model = model_dir("llama")
    env = {**served_env(root / "objects"), "HSX_ENGINE__MODEL": str(model)}
    with hsx_serve(root, env) as served:
        yield chat_run(served.url, root / "objects", model, root, rows=4)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[ServedRun]:
    root = tmp_path_factory.mktemp("export-demo")
    link_demo_model(root, demo_model)
    with hsx_serve(root, served_env(root / "objects")) as served:
        yield chat_run(served.url, root / "objects", demo_model, root, rows=2)


def gemma3_model(root: Path) -> Path:
    """The tiny Gemma 3 with a random final norm weight. transformers initialises every
    Gemma norm weight to zeros, which leave only the ``rsqrt`` part to check: a weight
    read from another of the checkpoint's norms, or an offset lost where the weight is
    zero, would pass unseen."""
    from safetensors.torch import load_file, save_file

    model = make_model(root / "gemma3", "gemma3")
    weights = load_file(model / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    weights["model.norm.weight"] = torch.randn(
        weights["model.norm.weight"].shape, generator=generator
    )
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedRun]:
    root = tmp_path_factory.mktemp("export-gemma3")
    model = gemma3_model(root)
    env = {**served_env(root / "objects"), "HSX_ENGINE__MODEL": str(model)}
    with hsx_serve(root, env) as served:
        yield chat_run(served.url, root / "objects", model, root, rows=2)


def read_specforge(dest: Path, strategy: str) -> dict[str, dict[str, torch.Tensor]]:
    batches = specforge_batches(dest / "data", strategy)
    return {
        str(Path(p).relative_to(dest)): {k: v[0] for k, v in t.items()} for p, t in batches.items()
    }


def read_modelopt(dest: Path) -> dict[str, dict[str, Any]]:
    return {
        str(Path(p).relative_to(dest)): item for p, item in modelopt_samples(dest / "data").items()
    }


def read_eagle(dest: Path) -> dict[str, dict[str, Any]]:
    files = [p for p in (dest / "data").rglob("*") if p.is_file()]  # EAGLE's list_files
    return {str(p.relative_to(dest)): torch.load(p) for p in files}


def read_speculators(dest: Path) -> dict[str, dict[str, Any]]:
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=256, datapath=str(dest), on_missing="raise")
    samples: dict[str, dict[str, Any]] = {}
    for i in range(len(dataset)):
        sample = dataset[i]
        assert isinstance(sample, dict), sample  # not SampleUnavailable: its file is there
        samples[f"hidden_states/hs_{i}.safetensors"] = sample
    return samples


#: layout -> (its export flags, its trainer's reader: {file under DEST: the sample}).
LAYOUTS: dict[str, tuple[list[str], Callable[[Path], dict[str, Any]]]] = {
    "specforge-eagle3": (["--format", "specforge"], lambda d: read_specforge(d, "eagle3")),
    "specforge-eagle3-gz": (
        ["--format", "specforge", "--compress"],
        lambda d: read_specforge(d, "eagle3"),
    ),
    "specforge-dflash": (
        ["--format", "specforge", "--specforge-layout", "dflash"],
        lambda d: read_specforge(d, "dflash"),
    ),
    "modelopt": (["--format", "modelopt"], read_modelopt),
    "eagle": (["--format", "eagle"], read_eagle),
    "speculators": (["--format", "speculators"], read_speculators),
}


#: hsx's default layer ids by the model's layer count (what the runs hold).
HELD = {4: [1, 2, 4], 30: [2, 15, 27, 30]}


def expected_tensors(
    layout: str, states: tuple[torch.Tensor, ...], last_before: torch.Tensor, num_layers: int
) -> dict[str, torch.Tensor]:
    """The reader's tensors as transformers computes them, with each trainer's default
    layers written out here from its own code (not from hsx's plan)."""
    L = num_layers
    eagle3 = [i + 1 for i in (1, L // 2 - 1, L - 4)]  # SpecForge ids + 1 = hsx ids
    modelopt = [i + 1 for i in sorted({1, max(0, L // 2 - 1), max(0, L - 4)})]
    held_below = [i for i in HELD[L] if i < L]
    after = states[L]  # transformers' last entry: after the final norm
    if layout.startswith("specforge-eagle3"):
        return {"hidden_state": aux_reference(states, eagle3), "target": after}
    if layout == "specforge-dflash":
        return {"hidden_states": aux_reference(states, held_below)}
    if layout == "modelopt":
        return {
            "aux_hidden_states": aux_reference(states, modelopt),
            "base_model_hidden_states": after,
        }
    if layout == "eagle":
        return {"hidden_state": after}
    return {
        "hidden_states": aux_reference(states, held_below),
        "verifier_last_hidden_states": last_before,
    }


# The tiny model's case in `make test`; SmolLM2's and Gemma 3's, each an engine of its
# own, are whole-system runs (`make test-system`).
@pytest.mark.parametrize(
    "which",
    [
        "tiny",
        pytest.param("demo", marks=pytest.mark.system),
        pytest.param("gemma3", marks=pytest.mark.system),
    ],
)
def test_every_layout_read_by_its_trainer_equals_transformers(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run: ServedRun = request.getfixturevalue(which)
    records = run.records()
    objects = {
        r["row"]: load_object((run.storage / r["key"]).read_bytes())[0] for r in records.values()
    }
    num_layers = int(json.loads((run.model / "config.json").read_text())["num_hidden_layers"])
    references: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
    worst: list[float] = []
    for layout, (flags, reader) in LAYOUTS.items():
        dest = tmp_path / layout
        code, text = export(capsys, run, run.output, dest, *flags, "--model", str(run.model))
        assert code == 0, text
        assert f"exported {len(records)} samples to {dest}" in text.splitlines()
        index = lengths(dest)
        # The length index is the objects': ids, tokens, supervised tokens, in input order.
        assert [e["row"] for e in index] == sorted(records)
        for entry in index:
            obj, record = objects[entry["row"]], records[entry["row"]]
            assert entry["custom_id"] == record["custom_id"]
            assert entry["num_tokens"] == record["num_tokens"] == obj["token_ids"].numel()
            assert (
                entry["num_loss_tokens"] == record["num_loss_tokens"] == int(obj["loss_mask"].sum())
            )
        read = reader(dest)
        assert sorted(read) == sorted(e["file"] for e in index)
        for entry in index:
            obj, sample = objects[entry["row"]], read[entry["file"]]
            ids = obj["token_ids"].tolist()
            assert sample["input_ids"].reshape(-1).tolist() == ids
            mask = sample["loss_mask"].reshape(-1)
            if layout.startswith("specforge-eagle3"):  # its normaliser zeroes the last
                assert mask[-1] == 0
                mask = mask[:-1]
            assert mask.tolist() == obj["loss_mask"][: mask.numel()].tolist()
            if tuple(ids) not in references:
                references[tuple(ids)] = (forward(run.model, ids), before_norm(run.model, ids))
            states, last_before = references[tuple(ids)]
            for key, want in expected_tensors(layout, states, last_before, num_layers).items():
                close(sample[key], want, f"{which} {layout} row {entry['row']} {key}", worst)
        described = manifest(dest)
        side = {"specforge-dflash": None, "speculators": "before"}.get(layout, "after")
        assert described["last_layer_norm"] == side
        assert (described["final_norm"] is not None) == (side == "after")
        if described["final_norm"] is not None:
            kind = "rmsnorm_1_plus_weight" if which == "gemma3" else "rmsnorm"
            assert described["final_norm"]["kind"] == kind
        assert described["left_out"] == []
    print(f"{which}: worst relative error {max(worst):.3g} over {len(worst)} tensors")


def test_layers_the_run_lacks_are_refused_in_one_line_and_nothing_is_written(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "refused"
    model = ["--model", str(tiny.model)]
    cases = [
        (["--format", "specforge", "--aux-layers", "0,1,2"],
         "specforge-eagle3 needs hsx layer ids [3] (the trainer's [2]; id 4 is the last layer), "
         "which the run does not hold (it holds [1, 2, 4]); run it with --layers including "
         "them, or choose --aux-layers"),
        (["--format", "specforge", "--specforge-layout", "dflash", "--aux-layers", "0,2"],
         "specforge-dflash needs hsx layer ids [3] (the trainer's [2]; id 4 is the last layer), "
         "which the run does not hold (it holds [1, 2, 4]); run it with --layers including "
         "them, or choose --aux-layers"),
        (["--format", "modelopt", "--aux-layers", "3"],
         "--aux-layers [3]: out of range; the trainer's ids of aux layers run 0..2 for this "
         "model of 4 layers"),
        (["--format", "modelopt", "--compress"],
         "--compress: only SpecForge reads gzipped files, not modelopt"),
    ]  # fmt: skip
    for flags, line in cases:
        code, text = export(capsys, tiny, tiny.output, dest, *flags, *model)
        assert (code, text.splitlines()) == (2, [f"hsx dataset: error: {line}"])
        assert not dest.exists()


def after_norm_everywhere(run: ServedRun, output: Path, stack: contextlib.ExitStack) -> None:
    """Make ``output`` (a copy of the run) a run of a server that stores the last layer
    after the final norm: every object's last layer normed with the target's own norm
    and its layer convention saying so, and job.json's provenance too."""
    norm = load_final_norm(run.model)
    after = "last layer's output after the final norm"

    def normed(tensors: dict[str, Any], metadata: dict[str, str]) -> None:
        tensors["hidden_states"][:, -1] = norm(tensors["hidden_states"][:, -1])
        key = "hsx.provenance.layer_convention"
        metadata[key] = metadata[key].replace("last layer's output before the final norm", after)

    for row in run.records():
        stack.enter_context(tampered(run, output, row, normed))
    job = json.loads((output / "job.json").read_text())
    convention = job["provenance"]["layer_convention"]
    job["provenance"]["layer_convention"] = convention.replace(
        "last layer's output before the final norm", after
    )
    (output / "job.json").write_text(json.dumps(job))


def test_a_run_stored_after_the_norm_is_converted_never_normed_twice_or_mixed(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tiny.copy(tmp_path / "run")
    model = ["--model", str(tiny.model)]
    with contextlib.ExitStack() as stack:
        after_norm_everywhere(tiny, output, stack)
        dest = tmp_path / "eagle"
        code, text = export(capsys, tiny, output, dest, "--format", "eagle", *model)
        assert code == 0, text
        described = manifest(dest)
        assert (described["final_norm"], described["objects"]["norm_side"]) == (None, "after")
        worst: list[float] = []
        for entry in lengths(dest):
            sample = torch.load(dest / entry["file"])
            states = forward(tiny.model, sample["input_ids"].tolist())
            close(sample["hidden_state"], states[-1], f"row {entry['row']}", worst)
        # speculators reads the last layer before the norm: that cannot be undone.
        code, text = export(capsys, tiny, output, tmp_path / "spec", "--format", "speculators")
        assert (code, text.splitlines()) == (2, [
            "hsx dataset: error: the run's objects hold the last layer after the final norm; "
            "speculators reads it before the norm, which cannot be undone; export another layout"
        ])  # fmt: skip
        assert not (tmp_path / "spec").exists()
    # One object of the other convention in a run of the first: refused, nothing left.
    mixed = tiny.copy(tmp_path / "mixed")
    with contextlib.ExitStack() as stack:
        after_norm_everywhere(tiny, mixed, stack)
        job = json.loads((tiny.output / "job.json").read_text())
        (mixed / "job.json").write_text(json.dumps(job))  # the run says "before" again
        dest = tmp_path / "mixed-export"
        code, text = export(capsys, tiny, mixed, dest, "--format", "eagle", *model)
    assert code == 2
    assert (
        "its object holds the last layer on the other side of the final norm from the run's" in text
    )
    assert not dest.exists()


def test_rows_with_non_finite_values_are_left_out_and_listed(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tiny.copy(tmp_path / "run")
    row = 1

    def poison(tensors: dict[str, Any], _metadata: dict[str, str]) -> None:
        tensors["hidden_states"][3, 0, 5] = float("nan")

    with tampered(tiny, output, row, poison) as record:
        dest = tmp_path / "sf"
        code, text = export(
            capsys, tiny, output, dest, "--format", "specforge", "--model", str(tiny.model)
        )
    assert code == 0, text
    assert text.splitlines()[0] == (
        f"exported 3 samples to {dest} (1 rows with non-finite values left out: hsx-export.json)"
    )
    described = manifest(dest)
    assert described["left_out"] == [
        {"row": row, "custom_id": record["custom_id"], "key": record["key"],
         "reason": "non-finite values in aux_hidden_state"}
    ]  # fmt: skip
    assert [e["row"] for e in lengths(dest)] == [0, 2, 3]
    assert [e["index"] for e in lengths(dest)] == [0, 1, 2]  # dense: data_0..data_2
    assert described["samples"] == 3


def test_vocab_maps_equal_speculators_and_modelopt_and_specforge_counts(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """speculators' own functions on its own dataset of the exported rows; ModelOpt's
    ``calibrate_frequent_vocab`` given the same supervised ids in export order (its
    tokenizer argument, which it calls once for the whole flat list, answers them);
    SpecForge's counter of loss-bearing tokens over its files."""
    import numpy as np
    from datasets import load_from_disk  # type: ignore[import-untyped]
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    from tests.dataset.trainer_readers import modelopt, specforge

    n = 24
    model = ["--model", str(tiny.model), "--vocab-map", str(n)]
    spec, sf = tmp_path / "spec", tmp_path / "sf"
    assert export(capsys, tiny, tiny.output, spec, "--format", "speculators", *model)[0] == 0
    assert export(capsys, tiny, tiny.output, sf, "--format", "specforge", *model)[0] == 0
    dataset = load_from_disk(str(spec)).with_format("torch")
    save_token_frequency_distribution(dataset, tmp_path / "freq.pt")
    freq = torch.load(tmp_path / "freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, n, 512)
    counted = specforge().vocab.count_effective_feature_tokens(str(sf / "data"))
    assert dict(counted) == freq
    supervised = [t for row in dataset for t in row["input_ids"][row["loss_mask"].bool()].tolist()]

    class Supervised:  # ModelOpt tokenises the whole calibration text in one call
        def apply_chat_template(self, _conversations: Any, **_kwargs: Any) -> list[int]:
            return supervised

    modelopt_map = modelopt().utils.calibrate_frequent_vocab(Supervised(), [], n)
    for dest in (spec, sf):
        assert np.array_equal(np.load(dest / f"d2t-{n}.npy"), d2t.numpy())
        assert np.array_equal(np.load(dest / f"t2d-{n}.npy"), t2d.numpy())
        assert torch.equal(torch.load(dest / "d2t.pt", weights_only=True), modelopt_map)
        assert manifest(dest)["vocab_map"]["padded"] == 0
