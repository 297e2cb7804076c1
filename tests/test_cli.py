"""The hsx command, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_hsx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_config_prints_effective_settings() -> None:
    proc = run_hsx("config", env={"HSX_STORAGE__URL": "s3://b/p", "HSX_SERVER__PORT": "9001"})
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert config["storage"]["url"] == "s3://b/p"
    assert config["server"]["port"] == 9001


def test_bad_environment_names_the_field() -> None:
    proc = run_hsx("config", env={"HSX_STORAGE__S3__PART_SIZE": "12"})
    assert proc.returncode != 0
    assert "part_size" in proc.stderr


def test_sweep_removes_stale_temp_files(tmp_path: Path) -> None:
    (tmp_path / ".hsx-tmp-x").write_bytes(b"partial")
    (tmp_path / "kept.safetensors").write_bytes(b"object")
    proc = run_hsx("sweep", "--older-than", "0", env={"HSX_STORAGE__URL": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "removed 1" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["kept.safetensors"]


@pytest.mark.system
@pytest.mark.slow
def test_make_model_writes_a_loadable_model(tmp_path: Path) -> None:
    proc = run_hsx("make-model", str(tmp_path / "m"), "--kind", "llama")
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(tmp_path / "m").num_hidden_layers == 4
    assert AutoTokenizer.from_pretrained(tmp_path / "m")("hello").input_ids


def test_misspelled_variable_is_refused_but_dict_keys_pass() -> None:
    typo = run_hsx("config", env={"HSX_STORAGE__S3__REGOIN": "eu-west-1"})
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "hsx: error: HSX_STORAGE__S3__REGOIN is not a setting; did you mean "
        "HSX_STORAGE__S3__REGION? fix or unset it (`hsx config` prints every setting)"
    )
    keyed = run_hsx("config", env={"HSX_ENGINE__EXTRA_ARGS__SEED": "3"})
    assert keyed.returncode == 0, keyed.stderr
    assert json.loads(keyed.stdout)["engine"]["extra_args"] == {"seed": "3"}


def test_client_variables_are_not_refused_as_settings() -> None:
    from service.config import Settings
    from service.startup import StartupError, check_environment

    check_environment({"HSX_API_KEY": "k" * 16, "HSX_STORAGE__URL": "/tmp/x"}, Settings)
    with pytest.raises(StartupError, match="HSX_API_KEYZ is not a setting"):
        check_environment({"HSX_API_KEYZ": "k"}, Settings)
