"""``hsx dataset verify`` on runs made by a real ``hsx serve``: parity against
transformers, the outlier check, token drift and mixed provenance.

One server per model for the whole module (the tiny random-weight Llama, and the real
SmolLM2 demo model), each making one small run (6 token-id rows, 6 chats). A test
that corrupts an object rewrites it in storage with a manifest line that matches it
(SHA-256, token count), so only the check under test can tell, and restores it.

The gap rule of half-precision runs is tested here on made-up errors (no server), and
on a real Qwen3-Next run in tests/engine/test_qwen3_next.py (its engine's module).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.dataset.parity import (
    DTYPE_BOUNDS,
    OFF_PATH_SLACK,
    ParityReport,
    compare_gap,
    layer_gaps,
    rule_for,
)
from tests.dataset.served_runs import (
    ServedRun,
    load_object,
    make_run,
    numpy_statistics,
    served_env,
    tampered,
    verify,
)
from tests.support.processes import hsx_serve, link_demo_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]
ROWS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_dir: Any) -> Iterator[ServedRun]:
    root = tmp_path_factory.mktemp("parity-tiny")
    model = model_dir("llama")
    env = {**served_env(root / "objects"), "HSX_ENGINE__MODEL": str(model)}
    with hsx_serve(root, env) as served:
        yield make_run(served.url, root / "objects", model, root, vocab=512)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[ServedRun]:
    root = tmp_path_factory.mktemp("parity-demo")
    link_demo_model(root, demo_model)
    with hsx_serve(root, served_env(root / "objects")) as served:
        yield make_run(served.url, root / "objects", demo_model, root, vocab=49152)


def parity(run: ServedRun, k: int = 8) -> list[str]:
    return ["--parity", str(k), "--parity-model", str(run.model)]


def failed_layers(text: str) -> set[tuple[int, int]]:
    """(row, layer) of every parity FAIL line's failed layers."""
    found = set()
    for line in text.splitlines():
        head = re.match(r"\s*FAIL row (\d+) ", line)
        if head:
            for layer in re.findall(r"layer (\d+): relative error", line):
                found.add((int(head.group(1)), int(layer)))
    return found


# SmolLM2's run, a server of its own, is a whole-system run: make test-system.
@pytest.mark.parametrize("which", ["tiny", pytest.param("demo", marks=pytest.mark.system)])
def test_parity_passes_on_a_run_made_by_hsx(
    which: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    run: ServedRun = request.getfixturevalue(which)
    code, text = verify(capsys, run, run.output, *parity(run))
    assert code == 0, text
    assert "parity: 8 rows" in text
    assert "0 failed" in text
    assert "before the final norm" in text  # the layer convention is stated
    report = json.loads((run.output / "parity.json").read_text())
    assert len(report["rows"]) == 8
    assert report["bound"] == DTYPE_BOUNDS["float32"]
    assert len({r["num_tokens"] for r in report["rows"]}) >= 6  # spread over lengths
    worst = max(layer["relative_error"] for r in report["rows"] for layer in r["layers"])
    print(f"{which}: worst relative error {worst:.3g}")  # the bound's margin, for the record
    assert worst < DTYPE_BOUNDS["float32"] / 10  # measured: tiny 3e-6, SmolLM2 3e-5
    # A fixed seed draws the same rows.
    verify(capsys, run, run.output, *parity(run))
    again = json.loads((run.output / "parity.json").read_text())
    assert [r["row"] for r in again["rows"]] == [r["row"] for r in report["rows"]]


def zero_layer(position: int) -> Any:
    def change(tensors: dict[str, Any], _metadata: dict[str, str]) -> None:
        tensors["hidden_states"][:, position] = 0

    return change


def shift_rows(tensors: dict[str, Any], _metadata: dict[str, str]) -> None:
    import torch

    tensors["hidden_states"] = torch.roll(tensors["hidden_states"], 1, dims=0)


def swap_in_next_layer(position: int) -> Any:
    def change(tensors: dict[str, Any], _metadata: dict[str, str]) -> None:
        states = tensors["hidden_states"]
        states[:, position] = states[:, position + 1].clone()

    return change


@pytest.mark.parametrize("corruption", ["zeros", "shifted", "wrong_layer"])
def test_parity_names_the_row_and_layer_of_a_corrupt_object(
    corruption: str, tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tiny.copy(tmp_path / "run")
    layer_ids = json.loads((output / "job.json").read_text())["fingerprint"]["layer_ids"]
    row, position = 3, 1
    change = {
        "zeros": zero_layer(position),
        "shifted": shift_rows,
        "wrong_layer": swap_in_next_layer(position),
    }[corruption]
    with tampered(tiny, output, row, change):
        code, text = verify(capsys, tiny, output, *parity(tiny, ROWS))
    assert code == 1, text
    failed = failed_layers(text)
    assert (row, layer_ids[position]) in failed, text
    assert {r for r, _ in failed} == {row}, text  # only that row
    if corruption != "shifted":  # a shift moves every layer; the others touch one
        assert failed == {(row, layer_ids[position])}, text
    report = json.loads((output / "parity.json").read_text())
    bad = [r for r in report["rows"] if not all(x["ok"] for x in r["layers"])]
    assert [r["row"] for r in bad] == [row]
    errors = [x["relative_error"] for x in bad[0]["layers"] if not x["ok"]]
    print(f"{corruption}: relative errors of the failed layers {errors}")


def test_verify_reports_a_row_whose_norms_are_outliers(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = verify(capsys, tiny, tiny.output)
    assert code == 0, text
    assert "outlier" not in text, text  # a clean run has none
    output = tiny.copy(tmp_path / "run")

    def scale(tensors: dict[str, Any], _metadata: dict[str, str]) -> None:
        tensors["hidden_states"] *= 50

    with tampered(tiny, output, 8, scale):
        code, text = verify(capsys, tiny, output)
    assert code == 1, text
    flagged = re.findall(r"row (\d+): layer \d+ median token norm \S+ is an outlier", text)
    assert set(flagged) == {"8"}, text


def other_template_ids(run: ServedRun, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model)
    tokenizer.chat_template = (
        "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:{% endif %}"
    )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_token_drift_reports_a_row_rendered_by_another_template(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    drift = ["--token-drift", "6", "--parity-model", str(tiny.model)]
    code, text = verify(capsys, tiny, tiny.output, *drift)
    assert code == 0, text
    assert "re-rendered 6 messages rows" in text
    output = tiny.copy(tmp_path / "run")
    row = 9
    ids = other_template_ids(tiny, tiny.rows[row]["messages"])

    def restore_from_other_template(tensors: dict[str, Any], _metadata: dict[str, str]) -> None:
        states = tensors["hidden_states"]
        tensors["hidden_states"] = states[torch.arange(len(ids)) % states.shape[0]].clone()
        tensors["token_ids"] = torch.tensor(ids, dtype=torch.int64)

    with tampered(tiny, output, row, restore_from_other_template):
        code, text = verify(capsys, tiny, output, *drift)
    assert code == 1, text
    drifted = re.findall(r"row (\d+) \(\S+\): token drift", text)
    assert drifted == [str(row)], text


def test_token_drift_reports_a_changed_template_hash(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny.model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    code, text = verify(
        capsys, tiny, tiny.output, "--token-drift", "3", "--parity-model", str(model)
    )
    assert code == 1, text
    assert "chat template SHA-256" in text
    assert "differs from the run's" in text
    assert len(re.findall(r"token drift: stored token ids", text)) == 3


def test_verify_refuses_objects_of_mixed_provenance_unless_allowed(
    tiny: ServedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tiny.copy(tmp_path / "run")
    first = load_object((tiny.storage / tiny.records()[0]["key"]).read_bytes())[1]
    served = {k: v for k, v in first.items() if k.startswith("hsx.provenance.")}

    def other_weights(_tensors: dict[str, Any], metadata: dict[str, str]) -> None:
        metadata["hsx.provenance.weights_sha256"] = "0" * 64

    with tampered(tiny, output, 5, other_weights):
        code, text = verify(capsys, tiny, output)
        assert code == 1, text
        assert "objects of 2 provenances" in text, text
        assert "weights_sha256" in text, text
        assert "--allow-mixed-provenance" in text
        code, text = verify(capsys, tiny, output, "--allow-mixed-provenance")
        assert code == 0, text
    if served:  # the server's part of issue 28: every object carries its provenance
        card = json.loads((tiny.output / "job.json").read_text())["provenance"]
        assert {f"hsx.provenance.{k}": v for k, v in card.items()} == served


def test_statistics_json_equals_numpy_over_the_stored_objects(tiny: ServedRun) -> None:
    stats = json.loads((tiny.output / "statistics.json").read_text())
    assert (stats["objects"], stats["objects_without_statistics"]) == (ROWS, 0), stats
    records = tiny.records()
    objects = [(tiny.storage / records[row]["key"]).read_bytes() for row in sorted(records)]
    expected = numpy_statistics(objects)
    for layer, want in zip(stats["layers"], expected, strict=True):
        for name, value in want.items():
            assert layer[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (layer["layer"], name)


def test_job_json_records_the_servers_provenance(tiny: ServedRun) -> None:
    import httpx

    card = httpx.get(f"{tiny.url}/v1/models", timeout=30).json()["data"][0]
    job = json.loads((tiny.output / "job.json").read_text())
    assert len(card["provenance"]["weights_sha256"]) == 64
    assert job["provenance"] == card["provenance"]


def test_without_parity_model_only_the_served_weights_are_loaded(
    tiny: ServedRun,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 58 (L2): the served name is the model directory's name; a ``./NAME`` of
    other weights in the working directory once gave "2 of 2 rows failed". Now it is
    refused (exit 2, one line), and a ``./NAME`` holding the served weights is used."""
    from service.engine.tiny_models import make_model

    output = tiny.copy(tmp_path / "run")
    name = json.loads((output / "job.json").read_text())["fingerprint"]["model"]
    monkeypatch.chdir(tmp_path)
    make_model(tmp_path / name, "llama", seed=1)  # same shape, other weights
    capsys.readouterr()
    code, text = verify(capsys, tiny, output, "--parity", "2")
    assert code == 2, text
    assert text.splitlines()[-1].startswith(f"hsx dataset: error: {name}: its weights (SHA-256 ")
    assert "are not the run's" in text
    assert "--parity-model" in text
    assert "FAIL" not in text

    shutil.rmtree(tmp_path / name)
    shutil.copytree(tiny.model, tmp_path / name)  # the served weights under the served name
    code, text = verify(capsys, tiny, output, "--parity", "2")
    assert code == 0, text
    assert f"parity: 2 rows against {name} " in text
    assert ": 0 failed" in text


def gap_case(seed: int = 0) -> tuple[Any, Any, Any]:
    """A float32 reference [40 tokens, 3 layers, 64], the reference's own bfloat16 states
    (rounding, and 3 tokens sent down another path: 0.4 off) and hsx's (its own rounding
    and 2 other tokens off the path), as a mixture of experts in bfloat16 gives them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    float32 = torch.randn(40, 3, 64, generator=generator, dtype=torch.float64)

    def rounded(off: list[int]) -> Any:
        noise = torch.randn(float32.shape, generator=generator, dtype=torch.float64)
        states = float32 + 4e-3 * noise * float32.norm(dim=-1, keepdim=True) / 8
        states[off] = float32[off] + 0.4 * torch.roll(float32[off], 1, dims=-1)
        return states

    return float32, rounded([5, 17, 30]), rounded([9, 22])


def test_the_gap_rule_passes_routing_ties_and_names_a_corrupt_layer() -> None:
    """Half precision: each layer of a row fails on more tokens off the float32 path than
    twice the reference's own, plus 2; a whole layer of the sample on that count or a
    median over the reference's 75th percentile (service/dataset/parity.py)."""
    assert rule_for("bfloat16", None) == rule_for("float16", None) == "gap"
    assert rule_for("float32", None) == rule_for("bfloat16", 0.1) == "norm"
    bound = DTYPE_BOUNDS["bfloat16"]
    float32, served, stored = gap_case()
    layers, ours, theirs = compare_gap(stored, float32, served, [0, 2, 4], bound)
    assert all(layer.ok for layer in layers)
    assert [layer.off_path for layer in layers] == [2, 2, 2]
    assert [layer.reference_off_path for layer in layers] == [3, 3, 3]
    assert all(layer.relative_error > bound for layer in layers)  # what the norm rule fails
    assert all(gap.ok for gap in layer_gaps(ours, theirs, [0, 2, 4], bound, 0.0))

    stored[:, 1] = float32[:, 2]  # layer 2 holds the next layer's states
    layers, ours, theirs = compare_gap(stored, float32, served, [0, 2, 4], bound)
    assert [layer.ok for layer in layers] == [True, False, True]
    assert layers[1].off_path == 40
    gaps = layer_gaps(ours, theirs, [0, 2, 4], bound, 0.0)
    assert [gap.ok for gap in gaps] == [True, False, True]

    # Tokens off the path where the reference has none: the slack, then a failure.
    float32, served, stored = gap_case(1)
    served[[5, 17, 30]] = float32[[5, 17, 30]]
    extra = list(range(OFF_PATH_SLACK + 1))
    stored[extra, 0] = 0.9 * float32[extra, 0]  # 0.1 off each
    layers, _, _ = compare_gap(stored, float32, served, [0, 2, 4], bound)
    assert (layers[0].off_path, layers[0].reference_off_path, layers[0].ok) == (5, 0, False)

    # Every token a little farther than the reference's rounding: the median fails.
    float32, served, stored = gap_case(2)
    drifted = float32 + 3 * (stored - float32)
    drifted[[9, 22]] = stored[[9, 22]]
    _, ours, theirs = compare_gap(drifted, float32, served, [0, 2, 4], bound)
    gaps = layer_gaps(ours, theirs, [0, 2, 4], bound, 0.0)
    assert not any(gap.ok for gap in gaps)
    assert all(gap.median > gap.median_bound for gap in gaps)
    # A codec's own bound is allowed on top (fp8: every token row within 3%).
    assert all(gap.ok for gap in layer_gaps(ours, theirs, [0, 2, 4], bound, 3e-2))


def test_a_gap_report_names_failed_rows_and_layers() -> None:
    from service.dataset.parity import RowParity

    float32, served, stored = gap_case()
    stored[:, 1] = 0
    layers, ours, theirs = compare_gap(stored, float32, served, [0, 2, 4], 0.05)
    row = RowParity(row=7, custom_id="r7", key="k", run="out", num_tokens=40, layers=layers)
    report = ParityReport(
        model="m", dtype="bfloat16", codec="raw", device="cpu", seed=0, requested=1,
        rule="gap", bound=0.05, min_cosine=None, rows=[row],
        layers=layer_gaps(ours, theirs, [0, 2, 4], 0.05, 0.0),
    )  # fmt: skip
    assert not report.ok
    text = "\n".join(report.lines())
    assert "held to transformers' own bfloat16 gap from float32" in text
    assert failed_layers(text) == {(7, 2)}
    assert "40 of 40 tokens off the float32 path (transformers' own: 3)" in text
    assert "  FAIL layer 2 over 40 tokens" in text
    assert "FAIL layer 4" not in text
