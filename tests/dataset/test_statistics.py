"""``statistics.json`` and ``job.json``'s provenance, against scripted hsx stand-ins that
store real objects and answer with each object's per-layer sums, as hsx does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.cli import main
from service.dataset import RunOptions, run_dataset
from service.dataset.statistics import outliers
from tests.dataset.served_runs import numpy_statistics
from tests.dataset.standins import MODEL, Reply, Scripted

LAYERS, HIDDEN = len(MODEL["layer_ids"]), MODEL["hidden_size"]


def states_of(custom_id: str, tokens: int) -> np.ndarray:
    """Deterministic float32 states per row: layers of different scales, one zero row."""
    seed = int(hashlib.sha256(custom_id.encode()).hexdigest()[:8], 16)
    states = np.random.default_rng(seed).normal(size=(tokens, LAYERS, HIDDEN))
    states *= np.array([1.0, 7.0])[None, :, None]
    states[0, 1] = 0.0  # an all-zero token row in layer 1
    return states.astype(np.float32)


def sums_of(states: np.ndarray) -> dict[str, Any]:
    """``LayerStatistics`` of one object, as the server computes it (float64)."""
    x = states.astype(np.float64)
    norms = np.linalg.norm(x, axis=-1)  # [T, L]
    return {
        "num_tokens": x.shape[0],
        "hidden_size": x.shape[2],
        "sum": x.sum(axis=(0, 2)).tolist(),
        "sum_sq": (x * x).sum(axis=(0, 2)).tolist(),
        "sum_abs": np.abs(x).sum(axis=(0, 2)).tolist(),
        "max_abs": np.abs(x).max(axis=(0, 2)).tolist(),
        "sum_token_norm": norms.sum(axis=0).tolist(),
        "zero_rows": (norms == 0).sum(axis=0).tolist(),
        "non_finite": (~np.isfinite(x)).sum(axis=(0, 2)).tolist(),
    }


def storing(server: Scripted, fail_after: int | None = None, found: bool = False) -> Any:
    """A script that stores each prompt's object and answers with its sums; with
    ``fail_after``, every request after that many prompts gets a 503; with ``found``,
    every third prompt's object is answered as found earlier, without sums (as hsx
    answers a retry whose object exists: its engine did not run)."""

    def script(body: dict[str, Any]) -> Reply:
        if fail_after is not None and server.prompts() > fail_after:
            return 503, {}, {"error": {"type": "unavailable", "message": "draining"}}
        from safetensors.numpy import save

        objects = []
        for index, prompt in enumerate(body["prompts"]):
            ids = prompt["token_ids"]
            states = states_of(prompt["custom_id"], len(ids))
            data = save({"hidden_states": states, "token_ids": np.array(ids, dtype=np.int64)})
            digest = hashlib.sha256(prompt["custom_id"].encode()).hexdigest()
            key = f"hsx/t/by-id/{digest[:2]}/{digest}.safetensors"
            server.objects[key] = data
            objects.append(
                {"index": index, "key": key, "uri": "file:///x", "num_tokens": len(ids),
                 "shape": list(states.shape), "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), "statistics": sums_of(states)}
            )  # fmt: skip
            if found and server.prompts() % 3 == 0:
                objects[-1].update(status="found", statistics=None)
        tokens = sum(o["num_tokens"] for o in objects)
        answer = {
            "id": "ext-standin", "model": MODEL["id"], "layer_ids": MODEL["layer_ids"],
            "dtype": "float32", "hidden_size": HIDDEN, "codecs": ["raw"], "objects": objects,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }  # fmt: skip
        return 200, {}, answer

    return script


def rows_file(tmp_path: Path, count: int = 30) -> Path:
    path = tmp_path / "rows.jsonl"
    rows = [{"token_ids": list(range(3, 3 + 2 + i % 9)), "n": i} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def options(tmp_path: Path, url: str, **extra: Any) -> RunOptions:
    return RunOptions(
        input=str(rows_file(tmp_path)),
        endpoints=[url],
        output=str(tmp_path / "out"),
        progress=False,
        batch_size=4,
        concurrency=1,
        backoff_base_s=0.01,
        backoff_max_s=0.02,
        **extra,
    )


def test_statistics_json_equals_numpy_over_the_objects_across_a_resume(
    tmp_path: Path, servers: Any
) -> None:
    first = servers(lambda body: (500, {}, {}))
    first.script = storing(first, fail_after=12)
    partial = run_dataset(options(tmp_path, first.url, retries=0, max_consecutive_errors=1))
    assert not partial.complete
    assert 0 < partial.ok < 30
    stats = json.loads((tmp_path / "out" / "statistics.json").read_text())
    assert stats["objects"] == partial.ok  # written by a stopped session too

    second = servers(lambda body: (500, {}, {}))
    second.script = storing(second, found=True)  # found objects: read back and summed
    summary = run_dataset(options(tmp_path, second.url))
    assert summary.complete
    assert summary.ok == 30
    stats = json.loads((tmp_path / "out" / "statistics.json").read_text())
    assert (stats["objects"], stats["objects_without_statistics"]) == (30, 0)
    assert summary.objects_found > 0
    objects = {**first.objects, **second.objects}
    records = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").open()]
    keys = {r["row"]: r["key"] for r in records if r["status"] == "ok"}
    expected = numpy_statistics([objects[keys[row]] for row in sorted(keys)])
    assert stats["tokens"] == expected[0]["token_rows"]
    for layer, want in zip(stats["layers"], expected, strict=True):
        for name, value in want.items():
            assert layer[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert [layer["layer"] for layer in stats["layers"]] == MODEL["layer_ids"]
    assert stats["layers"][1]["zero_row_fraction"] == pytest.approx(30 / stats["tokens"])


def test_a_run_without_server_statistics_says_so(tmp_path: Path, servers: Any) -> None:
    from tests.dataset.standins import stored

    summary = run_dataset(options(tmp_path, servers(stored).url))
    stats = json.loads((tmp_path / "out" / "statistics.json").read_text())
    assert (stats["objects"], stats["objects_without_statistics"]) == (0, summary.ok)


def test_outliers_use_a_robust_z_score_per_layer() -> None:
    norms = {row: [10.0 + row % 3, 100.0 + row % 5] for row in range(20)}
    assert outliers(norms, [1, 2]) == []
    norms[7] = [10.0, 5000.0]  # x50 in layer 2 only
    found = outliers(norms, [1, 2])
    assert len(found) == 1
    assert found[0].startswith("row 7: layer 2 median token norm 5000")
    norms[4] = [0.0, 100.0]  # an all-zero layer
    assert any(line.startswith("row 4: layer 1") for line in outliers(norms, [1, 2]))
    assert outliers({0: [1.0], 1: [99.0]}, [1]) == []  # too few rows to judge


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["dataset", *args])
    return code, capsys.readouterr().err


def test_job_records_provenance_and_a_resume_on_other_weights_is_refused(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.dataset.standins import stored

    provenance = {"weights_sha256": "a" * 64, "vllm_version": "0.32.0", "hsx_version": "0.1.0"}
    first = servers(stored)
    first.model = {**MODEL, "provenance": provenance}
    source, out = rows_file(tmp_path), tmp_path / "out"
    run = ["run", str(source), "--output", str(out), "--no-progress"]
    code, err = run_cli(capsys, *run, "--endpoint", first.url)
    assert code == 0, err
    assert json.loads((out / "job.json").read_text())["provenance"] == provenance

    other = servers(stored)
    other.model = {**MODEL, "provenance": {**provenance, "weights_sha256": "b" * 64}}
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run_cli(capsys, *run, "--endpoint", other.url)
    assert code == 2
    assert err.splitlines() == [
        f"hsx dataset: error: {out} was run against weights weights_sha256 "
        f"{'a' * 16}..., but the server serves {'b' * 16}...; use another --output, "
        "or --force to continue it anyway"
    ]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written

    code, err = run_cli(capsys, *run, "--endpoint", other.url, "--force")
    assert code == 0, err
    job = json.loads((out / "job.json").read_text())
    assert job["provenance"]["weights_sha256"] == "b" * 64

    # A server that does not say (an older hsx) cannot be compared, so it passes.
    older = servers(stored)
    assert run_cli(capsys, *run, "--endpoint", older.url)[0] == 0


def test_replicas_serving_other_weights_are_refused(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.dataset.standins import stored

    a, b = servers(stored), servers(stored)
    a.model = {**MODEL, "provenance": {"weights_sha256": "a" * 64}}
    b.model = {**MODEL, "provenance": {"weights_sha256": "b" * 64}}
    code, err = run_cli(
        capsys, "run", str(rows_file(tmp_path)), "--output", str(tmp_path / "out"),
        "--endpoint", a.url, "--endpoint", b.url, "--no-progress",
    )  # fmt: skip
    assert code == 2, err
    assert "serves tiny" in err, err
    assert not (tmp_path / "out").exists()
