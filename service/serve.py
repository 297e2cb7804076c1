"""``hsx serve``: uvicorn around ``create_app``, with a demo model and a graceful SIGTERM.

SIGTERM (what Kubernetes sends): readiness turns 503 at once, uvicorn stops accepting
connections and gives requests in flight ``server.shutdown_grace_s`` to finish, then the
app's lifespan closes the extractor, which drains the writer so every object whose key
was sent is durable. The exit status is 0.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn

from service.config import Settings

log = logging.getLogger(__name__)

#: Where ``hsx serve`` without a model keeps the demo model it makes once.
DEMO_MODEL_DIR = Path("var/models/tiny-llama")


def with_demo_model(settings: Settings, directory: Path = DEMO_MODEL_DIR) -> Settings:
    """``settings`` with a model: the configured one, else the tiny demo (made once)."""
    if settings.engine.model is not None:
        return settings
    from service.engine.tiny_models import make_model

    if not (directory / "config.json").exists():
        log.info("hsx: no model configured; making the tiny demo model in %s", directory)
        make_model(directory, "llama")
    engine = settings.engine.model_copy(
        update={
            "model": str(directory.resolve()),
            # Exact float32 and a small cache: the demo runs on any CPU. Eager: compiling
            # a 4-layer model buys nothing and costs about 40 s of start-up here.
            "dtype": "float32" if settings.engine.dtype == "auto" else settings.engine.dtype,
            "max_model_len": settings.engine.max_model_len or 2048,
            "extra_args": {"enforce_eager": True, **settings.engine.extra_args},
        }
    )
    return settings.model_copy(update={"engine": engine})


def serve(settings: Settings) -> int:
    """Run the service until SIGINT/SIGTERM; 0 after a clean drain."""
    from service.api.app import create_app

    configure_logging(settings)
    settings = with_demo_model(settings)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        timeout_graceful_shutdown=int(settings.server.shutdown_grace_s),
        log_level="info",
        access_log=False,
    )
    server = DrainingServer(config, on_exit=lambda: setattr(app.state.hsx, "draining", True))
    # After its graceful shutdown uvicorn re-raises the signal to the handler that was
    # installed before it started. A drained SIGTERM is a clean stop: make that handler
    # a no-op so the exit status is 0 (Kubernetes reads anything else as a crash).
    signal.signal(signal.SIGTERM, _already_drained)
    server.run()
    return 0 if server.started else 1


def configure_logging(settings: Settings) -> None:
    """hsx's own logs at INFO; with ``log_json`` the request log is bare JSON lines."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.log_json:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        requests = logging.getLogger("hsx.requests")
        requests.addHandler(handler)
        requests.propagate = False


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
