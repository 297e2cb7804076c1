"""A dataset run on an S3 store that only path-style addressing reaches (issue 27).

The objects (written by an hsx stand-in through the server's own S3 client factory) and
the run's state (job.json, manifest, errors, summary) both go to a moto server, and the
client's only S3 settings are ``HSX_STORAGE__S3__*`` and ``--s3-endpoint-url``, as for
the server's objects. The endpoint is a host name, and the AWS config file asks for
virtual-host addressing, so a client that ignored ``addressing_style=path`` would send
``bucket.localhost``: it does not resolve, and the request log would show it anyway.
No engine: the runner, the store and verify are real, the server is a stand-in.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import EndpointConnectionError
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

from service.cli import main
from service.config import S3StorageSettings
from service.storage.s3 import make_client
from tests.dataset.standins import Reply, stored


@dataclass
class PathOnlyS3:
    """A moto server that logs the ``Host`` and path of every request it gets."""

    endpoint: str
    bucket: str
    seen: list[tuple[str, str, str]] = field(default_factory=list)

    def settings(self) -> S3StorageSettings:
        return S3StorageSettings(
            endpoint_url=self.endpoint, addressing_style="path", region="us-east-1"
        )


@pytest.fixture
def path_only_s3(
    aws_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[PathOnlyS3]:
    backend = DomainDispatcherApplication(create_backend_app)
    seen: list[tuple[str, str, str]] = []

    def logged(environ: dict[str, Any], start_response: Any) -> Any:
        seen.append((environ["REQUEST_METHOD"], environ.get("HTTP_HOST", ""), environ["PATH_INFO"]))
        return backend(environ, start_response)

    server = make_server("127.0.0.1", 0, logged, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = tmp_path / "aws-config"  # what a bare boto3 client would take
    config.write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    endpoint, bucket = f"http://localhost:{server.server_port}", f"hsx-path-{uuid.uuid4().hex[:8]}"
    store = PathOnlyS3(endpoint, bucket, seen)
    make_client(store.settings(), 1).create_bucket(Bucket=store.bucket)
    yield store
    server.shutdown()
    server.server_close()


class S3Objects:
    """The stand-in's objects, in the bucket under ``objects/`` (read by GET /objects)."""

    def __init__(self, store: PathOnlyS3) -> None:
        self.bucket, self.client = store.bucket, make_client(store.settings(), 8)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"objects/{key}", Body=data)

    def get(self, key: str) -> bytes | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=f"objects/{key}")
        except self.client.exceptions.NoSuchKey:
            return None
        return bytes(answer["Body"].read())


def object_bytes(ids: list[int]) -> bytes:
    import torch
    from safetensors.torch import save

    return bytes(
        save({"hidden_states": torch.ones(len(ids), 2, 4), "token_ids": torch.tensor(ids)})
    )


def test_a_path_style_store_holds_the_objects_and_the_runs_state(
    path_only_s3: PathOnlyS3,
    servers: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    objects = S3Objects(path_only_s3)

    def storing(body: dict[str, Any]) -> Reply:
        status, headers, reply = stored(body)
        for obj, prompt in zip(reply["objects"], body["prompts"], strict=True):
            data = object_bytes(prompt["token_ids"])
            objects.put(obj["key"], data)
            obj.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        return status, headers, reply

    server = servers(storing)
    server.objects = objects
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"token_ids": [3, 4, 5 + i]}) + "\n" for i in range(12)))
    output = f"s3://{path_only_s3.bucket}/runs/x"
    monkeypatch.setenv("HSX_STORAGE__S3__ADDRESSING_STYLE", "path")
    monkeypatch.setenv("HSX_STORAGE__S3__MAX_ATTEMPTS", "2")
    endpoint = ["--endpoint", server.url, "--s3-endpoint-url", path_only_s3.endpoint]

    assert (
        main(["dataset", "run", str(source), "--output", output, "--no-progress", *endpoint]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert (summary["ok"], summary["complete"]) == (12, True)
    assert main(["dataset", "verify", output, *endpoint]) == 0
    assert "verified 12 objects of 12 manifest rows" in capsys.readouterr().out

    # Every request, the objects' and the state's, went path-style to the endpoint.
    host = path_only_s3.endpoint.removeprefix("http://")
    assert {h for _, h, _ in path_only_s3.seen} == {host}
    paths = [p for _, _, p in path_only_s3.seen]
    assert all(p.startswith(f"/{path_only_s3.bucket}") for p in paths)
    state = f"/{path_only_s3.bucket}/runs/x/"
    for written in ("job.json", "summary.json", "manifest/"):
        assert any(p.startswith(state + written) for p in paths), written
    assert any(p.startswith(f"/{path_only_s3.bucket}/objects/hsx/") for p in paths)

    # The control: a client that ignores the settings cannot reach this bucket at all.
    # A new session: boto3's default one may have read another AWS config file already.
    session = boto3.session.Session()
    one_try = Config(retries={"total_max_attempts": 1})
    bare = session.client("s3", endpoint_url=path_only_s3.endpoint, config=one_try)
    with pytest.raises(EndpointConnectionError, match=f"{path_only_s3.bucket}.localhost"):
        bare.get_object(Bucket=path_only_s3.bucket, Key="runs/x/job.json")
