"""``hsx serve`` as users run it: a real process, the demo model, SIGTERM mid-request; a
dead engine and a killed server (on the tiny model)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from service.serve import DrainingServer
from tests.support.processes import hsx_serve, link_demo_model, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.slow]
KEY = "serve-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def demo_model_here(tmp_path: Path, demo_model: Path) -> None:
    link_demo_model(tmp_path, demo_model)


def wait_in_flight(url: str, prompts: int, limit_s: float = 30) -> None:
    """Until the server has admitted ``prompts`` prompts that have not finished."""
    pattern = re.compile(r"^hsx_extract_prompts_in_flight (\S+)$", re.MULTILINE)

    def admitted() -> bool:
        found = pattern.search(httpx.get(f"{url}/metrics", timeout=5).text)
        return bool(found and float(found.group(1)) >= prompts)

    wait_until(admitted, limit_s, "the requests never got in flight", interval_s=0.05)


@pytest.mark.system
def test_serve_demo_model_and_sigterm_drains(tmp_path: Path) -> None:
    env = {
        "HSX_ENGINE__MAX_NUM_BATCHED_TOKENS": "64",
        "HSX_SERVER__SHUTDOWN_GRACE_S": "180",
        "HSX_SERVER__API_KEYS": f"team-x:{KEY}",
        "HSX_LOG_JSON": "true",
    }
    with hsx_serve(tmp_path, env) as served:
        proc, url = served.proc, served.url
        # No model configured: the demo model, under its directory's name.
        models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        results: list[Any] = []

        def extract() -> None:
            # 64 generated tokens: seconds of work, so SIGTERM surely meets it (it is sent
            # once all four are in flight); the grace leaves room for a busy host.
            body = {"prompts": [{"token_ids": list(range(3, 103))}], "max_tokens": 64}
            results.append(httpx.post(f"{url}/extract", json=body, timeout=240, headers=AUTH))

        threads = [threading.Thread(target=extract) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_in_flight(url, 4)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(240)
        assert proc.wait(240) == 0
    output = (tmp_path / "serve.log").read_text()
    assert "Waiting for connections to close" in output  # SIGTERM met requests in flight
    # One JSON line per request, with keys and timings, and never the API key.
    lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"event"')]
    assert len(lines) == 4
    assert all(line["namespace"] == "team-x" for line in lines)
    assert {line["objects"][0]["key"] for line in lines} == {
        r.json()["objects"][0]["key"] for r in results
    }
    assert KEY not in output
    assert [r.status_code for r in results] == [200] * 4, output[-3000:]
    for response in results:
        obj = response.json()["objects"][0]
        assert obj["key"].startswith("hsx/team-x/")
        path = tmp_path / "var/objects" / obj["key"]
        assert path.stat().st_size == obj["bytes"]
        assert list(load_file(path)["hidden_states"].shape) == obj["shape"]


def tiny_model(model_dir: Any) -> dict[str, str]:
    """The tiny test model instead of the demo, for tests about processes rather than
    the model; eager, as ``hsx serve`` runs the demo (compiling costs start-up time)."""
    return {
        "HSX_ENGINE__MODEL": str(model_dir("llama")),
        "HSX_ENGINE__DTYPE": "float32",
        "HSX_ENGINE__EXTRA_ARGS": json.dumps({"enforce_eager": True}),
    }


@pytest.mark.system
def test_dead_engine_makes_health_and_extract_503(tmp_path: Path, model_dir: Any) -> None:
    import psutil

    with hsx_serve(tmp_path, tiny_model(model_dir)) as served:
        proc, url = served.proc, served.url
        assert httpx.get(f"{url}/health").status_code == 200
        for child in psutil.Process(proc.pid).children(recursive=True):
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                child.kill()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health never noticed the dead engine"
            time.sleep(0.2)
        assert httpx.get(f"{url}/ready").status_code == 503
        response = httpx.post(
            f"{url}/extract", json={"prompts": [{"token_ids": [1, 2]}]}, timeout=30
        )
        assert response.status_code == 503
        assert response.json()["error"]["type"] in ("unavailable", "engine_unavailable")
    assert "no API keys configured" in (tmp_path / "serve.log").read_text()


def huge_pages_of_workers(server_pid: int) -> list[int]:
    """AnonHugePages (kB) of each ``VLLM::Worker`` process under ``server_pid``."""
    import psutil

    workers = [
        child
        for child in psutil.Process(server_pid).children(recursive=True)
        if child.cmdline()[:1] and child.cmdline()[0].startswith("VLLM::Worker")
    ]
    assert workers, "no VLLM::Worker process under hsx serve"
    sizes = []
    for worker in workers:
        rollup = Path(f"/proc/{worker.pid}/smaps_rollup").read_text()
        found = re.search(r"^AnonHugePages:\s+(\d+) kB", rollup, re.MULTILINE)
        assert found, rollup
        sizes.append(int(found.group(1)))
    return sizes


@pytest.mark.system
def test_engine_processes_exit_when_the_server_is_killed(tmp_path: Path, model_dir: Any) -> None:
    """Two things of one server, to start one engine rather than two:

    - ``hsx serve`` as users start it (no switch in its environment) backs the worker's
      large tensors (weights, KV cache, activations) with transparent huge pages
      (``engine.cpu_huge_pages``, ``service/engine/hugepages.py``), where the kernel
      gives them to memory that asks (its mode ``madvise`` or ``always``);
    - SIGKILL, as an OOM kill or a drain past its grace period would: no handler runs,
      so only the engine's own watch on its parent can end the EngineCore and worker.

    The server runs its completion channel on TCP (a free port), as it would with the
    writing rank on another node: an extraction first shows that channel works.
    """
    import psutil

    from service.engine.hugepages import system_mode

    env = {**tiny_model(model_dir), "HSX_ENGINE__COMPLETION_ADDRESS": "tcp://127.0.0.1:0"}
    with hsx_serve(tmp_path, env) as served:
        proc = served.proc
        answer = httpx.post(
            f"{served.url}/extract", json={"prompts": [{"token_ids": [5, 6, 7]}]}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["objects"][0]["num_tokens"] == 3
        assert "reached the API" in served.output()
        if system_mode() in ("madvise", "always"):  # else the kernel gives none here
            assert all(size >= 2048 for size in huge_pages_of_workers(proc.pid))
        engine = psutil.Process(proc.pid).children(recursive=True)
        assert any("EngineCore" in " ".join(child.cmdline()) for child in engine)
        proc.kill()
        proc.wait(30)
        _gone, alive = psutil.wait_procs(engine, timeout=30)
    for child in alive:  # do not leave them behind even when the test fails
        child.kill()
    assert not alive, [child.cmdline() for child in alive]
    assert "the process that started this engine is gone" in (tmp_path / "serve.log").read_text()


def test_signal_marks_the_app_draining_before_uvicorn_stops() -> None:
    import uvicorn

    seen: list[bool] = []
    server = DrainingServer(uvicorn.Config(app=None), on_exit=lambda: seen.append(True))
    server.handle_exit(signal.SIGTERM, None)
    assert seen == [True]
    assert server.should_exit
