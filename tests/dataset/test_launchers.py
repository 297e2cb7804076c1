"""Which shard a process takes: ``--shard``, ``--world-size``/``--rank``, Slurm arrays and
Kubernetes Indexed Jobs (``service.dataset.launch``), against a scripted stand-in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.dataset.inputs import iter_rows, open_source
from service.dataset.launch import (
    K8S_INDEX,
    SHARDS_ENV,
    SLURM_COUNT,
    SLURM_ID,
    SLURM_MAX,
    SLURM_MIN,
    SLURM_STEP,
    LaunchError,
    ShardChoice,
    resolve_shard,
)
from tests.dataset.standins import stored

LAUNCH_VARS = (SLURM_ID, SLURM_COUNT, SLURM_MIN, SLURM_MAX, SLURM_STEP, K8S_INDEX, SHARDS_ENV)
ROWS = 24


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' own environment may be a Slurm job: start from none of its variables."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def rows_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"token_ids": [3, 4, 5 + i]}) + "\n" for i in range(ROWS)))
    return path


# ---------------------------------------------------------------- resolution


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ({}, {}, ShardChoice(None)),
        ({"shard": "3/8"}, {}, ShardChoice((3, 8), "--shard")),
        ({"world_size": 8, "rank": 3}, {}, ShardChoice((3, 8), "--world-size/--rank")),
        ({"shard": "3/8", "world_size": 8}, {}, ShardChoice((3, 8), "--shard")),
        ({}, {SLURM_ID: "3", SLURM_COUNT: "8"}, ShardChoice((3, 8), SLURM_ID)),
        # A 1-based array (--array=1-8): index = ID - MIN.
        ({}, {SLURM_ID: "4", SLURM_COUNT: "8", SLURM_MIN: "1"}, ShardChoice((3, 8), SLURM_ID)),
        (
            {},
            {SLURM_ID: "13", SLURM_COUNT: "8", SLURM_MIN: "10", SLURM_MAX: "17", SLURM_STEP: "1"},
            ShardChoice((3, 8), SLURM_ID),
        ),
        ({"world_size": 8}, {SLURM_ID: "3"}, ShardChoice((3, 8), SLURM_ID)),
        ({}, {K8S_INDEX: "3", SHARDS_ENV: "8"}, ShardChoice((3, 8), K8S_INDEX)),
        ({"world_size": 8}, {K8S_INDEX: "3"}, ShardChoice((3, 8), K8S_INDEX)),
        # Explicit flags win over the environment.
        ({"shard": "1/2"}, {SLURM_ID: "3", SLURM_COUNT: "8"}, ShardChoice((1, 2), "--shard")),
        (
            {"world_size": 2, "rank": 1},
            {K8S_INDEX: "3", SHARDS_ENV: "8"},
            ShardChoice((1, 2), "--world-size/--rank"),
        ),
    ],
)
def test_the_shard_comes_from_flags_then_the_environment(
    flags: dict[str, Any], env: dict[str, str], expected: ShardChoice
) -> None:
    assert resolve_shard(environ=env, **flags) == expected


@pytest.mark.parametrize(
    ("flags", "env", "names"),
    [
        ({"shard": "1/4", "rank": 1}, {}, ["--shard", "--rank"]),
        ({"rank": 1}, {}, ["--rank", "--world-size"]),
        ({"world_size": 4, "rank": 4}, {}, ["--world-size 4 --rank 4"]),
        ({"world_size": 4, "rank": -1}, {}, ["--rank -1"]),
        ({"world_size": 0, "rank": 0}, {}, ["--world-size 0"]),
        ({"shard": "x"}, {}, ["--shard 'x'"]),
        ({"shard": "1/4", "world_size": 8}, {}, ["--shard 1/4", "--world-size 8"]),
        ({"world_size": 4}, {}, ["--world-size 4", "--rank"]),
        ({}, {SLURM_ID: "abc", SLURM_COUNT: "4"}, [SLURM_ID, "'abc'"]),
        ({}, {SLURM_ID: "1", SLURM_COUNT: "four"}, [SLURM_COUNT]),
        ({}, {SLURM_ID: "4", SLURM_COUNT: "4"}, [SLURM_ID, SLURM_COUNT]),
        ({}, {SLURM_ID: "0", SLURM_COUNT: "4", SLURM_MIN: "1"}, [SLURM_ID, SLURM_MIN]),
        ({}, {SLURM_ID: "1"}, [SLURM_COUNT, "--world-size"]),
        ({}, {SLURM_ID: "2", SLURM_COUNT: "4", SLURM_STEP: "2"}, [SLURM_STEP]),
        ({}, {SLURM_ID: "2", SLURM_COUNT: "3", SLURM_MIN: "0", SLURM_MAX: "4"}, [SLURM_MAX]),
        ({"world_size": 8}, {SLURM_ID: "1", SLURM_COUNT: "4"}, ["--world-size 8", SLURM_COUNT]),
        ({}, {K8S_INDEX: "2"}, [K8S_INDEX, "--world-size", SHARDS_ENV]),
        ({}, {K8S_INDEX: "x", SHARDS_ENV: "4"}, [K8S_INDEX]),
        ({}, {K8S_INDEX: "4", SHARDS_ENV: "4"}, [K8S_INDEX, SHARDS_ENV]),
        ({}, {K8S_INDEX: "1", SHARDS_ENV: "zero"}, [SHARDS_ENV]),
        ({"world_size": 8}, {K8S_INDEX: "1", SHARDS_ENV: "4"}, ["--world-size 8", SHARDS_ENV]),
        ({}, {K8S_INDEX: "1", SLURM_ID: "1", SLURM_COUNT: "4"}, [K8S_INDEX, SLURM_ID]),
    ],
)
def test_contradictions_and_bad_values_are_one_line_naming_the_flag_or_variable(
    flags: dict[str, Any], env: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(LaunchError) as caught:
        resolve_shard(environ=env, **flags)
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name in message, (name, message)


def test_a_bad_launch_is_exit_2_with_one_line_and_nothing_written(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    server = servers(stored)
    monkeypatch.setenv(SLURM_ID, "9")
    monkeypatch.setenv(SLURM_COUNT, "8")
    out = tmp_path / "out"
    code = main(["dataset", "run", str(rows_file(tmp_path)), "--endpoint", server.url,
                 "--output", str(out), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"hsx dataset: error: {SLURM_ID}=9 (minus {SLURM_MIN}=0) is not a shard of "
                   f"{SLURM_COUNT}=8: need 0 <= ID - MIN < COUNT"]  # fmt: skip
    assert not out.exists()
    assert server.bodies == []


# ---------------------------------------------------------------- the rows each shard runs


def launches(index: int, count: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Every way to ask for shard ``index`` of ``count``: extra flags and environment."""
    return {
        "shard": ([f"--shard={index}/{count}"], {}),
        "rank": (["--world-size", str(count), "--rank", str(index)], {}),
        "slurm": ([], {SLURM_ID: str(index), SLURM_COUNT: str(count)}),
        "slurm-1-based": (
            [],
            {
                SLURM_ID: str(index + 1),
                SLURM_COUNT: str(count),
                SLURM_MIN: "1",
                SLURM_MAX: str(count),
                SLURM_STEP: "1",
            },
        ),
        "k8s-env": ([], {K8S_INDEX: str(index), SHARDS_ENV: str(count)}),
        "k8s-flag": (["--world-size", str(count)], {K8S_INDEX: str(index)}),
    }


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_launcher_runs_the_rows_of_shard(
    count: int,
    tmp_path: Path,
    servers: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = servers(stored)
    source = rows_file(tmp_path)
    every = {row.custom_id for row in iter_rows(open_source(source))}
    assert len(every) == ROWS
    by_launch: dict[str, list[set[str]]] = {}
    for index in range(count):
        for name, (flags, env) in launches(index, count).items():
            with monkeypatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                server.bodies.clear()
                out = tmp_path / name / "out"
                code = main(["dataset", "run", str(source), "--endpoint", server.url,
                             "--output", str(out), "--no-progress", *flags])  # fmt: skip
            err = capsys.readouterr().err
            assert code == 0, (name, err)
            origin = {"shard": "--shard", "rank": "--world-size/--rank"}.get(name)
            origin = origin or (SLURM_ID if name.startswith("slurm") else K8S_INDEX)
            assert f"hsx dataset: shard {index}/{count} from {origin}\n" in err, (name, err)
            sent = {p["custom_id"] for body in server.bodies for p in body["prompts"]}
            by_launch.setdefault(name, []).append(sent)
            shard_dir = out / f"shard-{index:05d}-of-{count:05d}"
            job = json.loads((shard_dir / "job.json").read_text())
            assert job["fingerprint"]["shard"] == f"{index}/{count}"
    reference = by_launch.pop("shard")
    for name, shards in by_launch.items():
        assert shards == reference, name  # the same rows, shard by shard
    # The shards partition the input: disjoint, and every row in one of them.
    assert sum(len(s) for s in reference) == ROWS
    assert set().union(*reference) == every


def test_no_shard_and_no_launcher_runs_every_row_and_says_nothing(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    server = servers(stored)
    monkeypatch.setenv(SHARDS_ENV, "4")  # torch's variable alone chooses no shard
    code = main(["dataset", "run", str(rows_file(tmp_path)), "--endpoint", server.url,
                 "--output", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 0
    assert "shard" not in capsys.readouterr().err
    assert server.prompts() == ROWS
