"""The README's front door, run as written on a fresh clone.

The commands are parsed out of README.md, not copied here, so the test breaks when the
README and the code part ways: ``make serve`` in a clean environment (no ``HSX_`` or
``VLLM_`` variables, so a setting that the README does not give makes it fail), the
quickstart ``curl``, the read-back snippet, and SIGTERM. ``.ci/run`` must run the
README's test command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.demo_model import DEMO_DIR
from tests.support.processes import SET_BY_HSX, SUITE_ONLY
from tests.support.processes import wait_ready as support_wait_ready

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PORT = 8000  # the README's


def two_commands() -> dict[str, str]:
    """``what -> command`` from the README's "The two commands" table."""
    section = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| `([^`]+)` \|", section, re.MULTILINE)
    return dict(rows)


def fenced(after: str, language: str) -> str:
    """The first ```language block after the text ``after``."""
    rest = README.split(after, 1)[1]
    found = re.search(rf"```{language}\n(.*?)```", rest, re.DOTALL)
    assert found, f"no {language} block after {after!r} in README.md"
    return found.group(1)


#: Where the quickstart's second command, the ``/extract`` one, begins.
EXTRACT_ANCHOR = "`/extract` is hsx's own route"


def quickstart() -> tuple[str, str, str]:
    """The quickstart's serve command, its chat ``curl`` and its ``/extract`` ``curl``
    (continuations kept)."""
    lines = fenced("## Quickstart", "bash").splitlines()
    serve = lines[0].split("#", 1)[0].strip()
    chat = "\n".join(lines[1:]).strip()
    extract = fenced(EXTRACT_ANCHOR, "bash").strip()
    for curl in (chat, extract):
        assert curl.startswith("curl "), curl
    return serve, chat, extract


def example(after: str) -> dict[str, Any]:
    """The example answer after ``after``; ``…`` stands for what varies."""
    text = fenced(after, "json").replace(", …]", "]").replace(", …}", "}")
    return dict(json.loads(text))


def chat_example() -> dict[str, Any]:
    return example("## Quickstart")


def example_response() -> dict[str, Any]:
    """The quickstart's ``/extract`` answer."""
    return example(EXTRACT_ANCHOR)


def test_ci_runs_the_readme_test_command() -> None:
    script = (ROOT / ".ci/run").read_text().splitlines()
    setup = ("#", "set ", "cd ")  # comments and shell set-up, not commands
    commands = [line for line in script if line.strip() and not line.startswith(setup)]
    assert commands == [two_commands()["run the tests"]]


def test_make_serve_adds_no_settings_of_its_own() -> None:
    # The fresh-clone test runs `make serve` without HSX_ or VLLM_ variables; a setting
    # put into the Makefile instead would pass it while `hsx serve`, as the README's
    # configuration section shows it, still failed. The recipe is the bare command.
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^serve:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "no serve target in the Makefile"
    assert recipe.group(1) == "\t$(VENV)/bin/hsx serve\n"
    assert not re.search(r"^\s*export\b|\b(?:HSX|VLLM)_\w*\s*[:?]?=", makefile, re.MULTILINE)


def test_readme_example_names_the_demo_model() -> None:
    commands = two_commands()
    assert commands["start the service"] == "make serve"
    assert quickstart()[0] == commands["start the service"]
    # The served name (the demo model's directory name), never a path.
    assert example_response()["model"] == chat_example()["model"] == DEMO_DIR.name
    assert chat_example()["model"] == "SmolLM2-135M-Instruct"


# -- the real thing -------------------------------------------------------------------


def fresh_clone(tmp: Path) -> Path:
    """``git clone`` of this repository plus the working tree's uncommitted files (the
    code under test), with ``.venv`` pointing at the venv running this test.

    Building a venv takes minutes and gigabytes; the clone borrows this one. Make
    rebuilds the venv when ``pyproject.toml`` is newer than the venv's stamp, and a
    clone's files are brand new: the clone's ``pyproject.toml`` gets the stamp's age so
    that ``make serve`` reuses the venv (it would otherwise reinstall the shared venv
    from the clone). The rest of the Makefile runs as written.
    """
    clone = tmp / "hsx"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    venv = Path(sys.prefix)
    stamp = venv / ".hsx-installed"
    if not stamp.exists():
        pytest.skip(f"{venv} was not built by `make install` (no {stamp.name})")
    (clone / ".venv").symlink_to(venv, target_is_directory=True)
    age = stamp.stat().st_mtime - 60
    os.utime(clone / "pyproject.toml", (age, age))
    up_to_date = subprocess.run(["make", "-q", ".venv/.hsx-installed"], cwd=clone, check=False)
    assert up_to_date.returncode == 0, "make would rebuild the shared venv"
    return clone


def clean_environment(clone: Path) -> dict[str, str]:
    """This environment without hsx's and vLLM's variables, and without those
    ``make test`` sets for the suite alone (``SUITE_ONLY``) or an engine of the suite's
    set in it (``SET_BY_HSX``).

    PYTHONPATH: the venv's editable install points at the checkout that built it; a
    fresh install in the clone would run the clone's code, so the clone goes first.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HSX_", "VLLM_")) and k not in (*SUITE_ONLY, *SET_BY_HSX)
    }
    return {**env, "PYTHONPATH": str(clone)}


def wait_ready(proc: subprocess.Popen[bytes], log: Path, limit_s: float = 600) -> None:
    try:
        support_wait_ready(f"http://127.0.0.1:{PORT}", proc, log, limit_s)
    except AssertionError as error:
        raise AssertionError(f"make serve: {error}\n{log.read_text()[-3000:]}") from None


def hsx_process(make: subprocess.Popen[bytes]) -> Any:
    """The ``hsx serve`` process that ``make serve`` started."""
    import psutil

    for child in psutil.Process(make.pid).children(recursive=True):
        if "serve" in child.cmdline() and any("hsx" in part for part in child.cmdline()):
            return child
    raise AssertionError("no hsx serve process under make")


def port_is_free() -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", PORT))
        except OSError:
            return False
    return True


def check_answer(answer: dict[str, Any], objects: Path) -> None:
    """The answer has the README example's shape and values, where they do not vary
    (the byte count does: the metadata holds the model's absolute path)."""
    example = example_response()
    for field in ("layer_ids", "dtype", "hidden_size", "usage"):
        assert answer[field] == example[field], field
    assert len(answer["objects"]) == 2
    got, shown = answer["objects"][0], example["objects"][0]
    for field in ("index", "num_tokens", "shape"):
        assert got[field] == shown[field], field
    prefix = "/".join(shown["key"].split("/")[:2])  # "hsx/default"
    for obj in answer["objects"]:
        assert re.fullmatch(rf"{prefix}/\d{{4}}/\d\d/\d\d/[0-9a-f]{{32}}\.safetensors", obj["key"])
        assert obj["uri"] == (objects / obj["key"]).as_uri()
        assert (objects / obj["key"]).stat().st_size == obj["bytes"]


def run_curl(curl: str, clone: Path, env: dict[str, str]) -> dict[str, Any]:
    """A ``curl`` command of the README as written; its JSON answer (status 200)."""
    reply = subprocess.run(
        ["bash", "-c", curl + " -w '\\n%{http_code}'"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    body, status = reply.rsplit("\n", 1)
    assert status == "200", body
    return dict(json.loads(body))


def check_chat_answer(answer: dict[str, Any]) -> None:
    """The chat answer says what the README's example says: SmolLM2's own greedy reply,
    and the object holding the prompt's states."""
    shown = chat_example()
    assert answer["model"] == shown["model"]
    assert answer["usage"] == {**answer["usage"], **shown["usage"]}
    got, expected = answer["choices"][0], shown["choices"][0]
    assert got["message"]["content"] == expected["message"]["content"]
    assert got["finish_reason"] == expected["finish_reason"]
    for field in ("num_tokens", "shape", "codec"):
        assert got["kv_transfer_params"][field] == expected["kv_transfer_params"][field], field


def read_back(clone: Path, env: dict[str, str], key: str) -> dict[str, Any]:
    """The README's read-back snippet with ``key`` filled in; what it loaded."""
    snippet = fenced("Read one back:", "python")
    code, count = re.subn(r'^key = "[^"]*"', f"key = {json.dumps(key)}", snippet, flags=re.M)
    assert count == 1, "the snippet has no `key = ...` line"
    code += (
        "\nimport json\nprint(json.dumps({'shape': list(tensors['hidden_states'].shape),"
        " 'token_ids': tensors['token_ids'].tolist(), 'dtype': str(tensors['token_ids'].dtype)}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=clone, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.engine
@pytest.mark.slow
def test_make_serve_on_a_fresh_clone(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed; the README's quickstart uses it")
    if not port_is_free():
        pytest.skip(f"port {PORT} is in use; the README's commands need it")
    clone = fresh_clone(tmp_path)
    env = clean_environment(clone)
    serve, chat, extract = quickstart()
    log = tmp_path / "make-serve.log"
    with log.open("wb") as out:
        make = subprocess.Popen(
            ["bash", "-c", serve],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_ready(make, log)
        assert (clone / DEMO_DIR / "model.safetensors").is_file()  # prepared by make serve
        answer = run_curl(chat, clone, env)
        check_chat_answer(answer)
        stored = answer["choices"][0]["kv_transfer_params"]
        loaded = read_back(clone, env, stored["key"])
        assert loaded["shape"] == stored["shape"]
        assert len(loaded["token_ids"]) == stored["num_tokens"] == answer["usage"]["prompt_tokens"]
        assert loaded["token_ids"][0] == 1  # <|im_start|>: the ChatML template rendered it

        answer = run_curl(extract, clone, env)
        check_answer(answer, clone / "var/objects")
        loaded = read_back(clone, env, answer["objects"][1]["key"])
        assert loaded == {
            "shape": answer["objects"][1]["shape"],
            "token_ids": [1, 15, 27],  # the quickstart's second prompt
            "dtype": "torch.int64",
        }
        hsx_process(make).send_signal(signal.SIGTERM)
        assert make.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait(30)
    output = log.read_text()
    assert "Application startup complete" in output  # what the README says to wait for
    assert "Traceback" not in output
