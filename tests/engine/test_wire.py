"""The typed boundary between processes: what each side accepts, and what it costs to import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from service.config import Settings
from service.engine.wire import (
    REQUEST_ARG,
    Completion,
    ConnectorConfig,
    Extraction,
    RequestParams,
    StoredObject,
    WriteFailure,
)

KEY = "hsx/team/2026/01/01/" + "a" * 32 + ".safetensors"


def test_connector_config_survives_the_trip_through_vllm() -> None:
    settings = Settings(storage={"url": "s3://bucket/prefix", "s3": {"max_attempts": 7}})
    config = ConnectorConfig(
        model_name="m",
        completion_address="ipc:///tmp/x.sock",
        storage=settings.storage,
        max_bytes_in_flight=1024,
    )
    extra = config.to_extra_config()
    assert isinstance(extra["storage"], dict)  # plain data: vLLM copies it around
    again = ConnectorConfig.from_extra_config(extra)
    assert again == config
    assert again.storage.s3.max_attempts == 7
    with pytest.raises(ValidationError, match="max_bytes_in_flight"):
        ConnectorConfig.from_extra_config({**extra, "max_bytes_in_flight": 0})
    with pytest.raises(ValidationError, match="unexpected"):
        ConnectorConfig.from_extra_config({**extra, "unexpected": 1})


def test_request_params_are_validated_where_they_are_read() -> None:
    params = RequestParams(key=KEY, metadata={"run": "r1"})
    extra_args = params.to_extra_args()
    assert list(extra_args) == [REQUEST_ARG]
    assert RequestParams.from_extra_args(extra_args) == params
    assert RequestParams.from_extra_args(None) is None
    assert RequestParams.from_extra_args({"other": 1}) is None
    with pytest.raises(ValidationError, match="key"):
        RequestParams.from_extra_args({REQUEST_ARG: {"key": "../etc/passwd"}})
    with pytest.raises(ValidationError, match="include_output_tokens"):
        RequestParams.from_extra_args({REQUEST_ARG: {"key": KEY, "include_output_tokens": []}})


def test_loss_spans_travel_as_plain_ranges() -> None:
    params = RequestParams(key=KEY, loss_spans=((0, 2), (5, 9)))
    extra_args = params.to_extra_args()
    assert extra_args[REQUEST_ARG]["loss_spans"] == [[0, 2], [5, 9]]  # plain data for vLLM
    assert RequestParams.from_extra_args(extra_args) == params
    assert RequestParams(key=KEY).loss_spans is None  # no mask asked for
    for bad in ([[3, 1]], [[-1, 2]], [[0, 1, 2]], [["a", 1]]):
        with pytest.raises(ValidationError, match="loss_spans"):
            RequestParams.from_extra_args({REQUEST_ARG: {"key": KEY, "loss_spans": bad}})


def test_a_completion_holds_exactly_one_outcome() -> None:
    stored = StoredObject(key=KEY, uri="u", size=1, sha256="s", num_tokens=1, shape=(1, 2, 3))
    failure = WriteFailure(type="storage_error", message="m")
    assert Completion.decode(Completion(key=KEY, stored=stored).encode()).stored == stored
    for both_or_none in ({"stored": stored, "failure": failure}, {}):
        with pytest.raises(ValidationError, match="exactly one"):
            Completion(key=KEY, **both_or_none)  # type: ignore[arg-type]


def test_an_extraction_is_the_stored_object_plus_the_prompt() -> None:
    stored = StoredObject(key=KEY, uri="u", size=1, sha256="s", num_tokens=3, shape=(3, 2, 8))
    result = Extraction(**stored.model_dump(), prompt_tokens=3, output_token_ids=(5,))
    assert (result.key, result.shape, result.prompt_tokens) == (KEY, (3, 2, 8), 3)


def test_the_api_imports_neither_torch_nor_vllm() -> None:
    """Route modules read the engine's errors and messages without loading the engine.

    (The OpenAI routes are the exception by design: they parse with vLLM's own protocol
    models, so ``service.api.app``, which includes them, loads vLLM.)
    """
    code = (
        "import sys, service.api.routes.extract, service.api.routes.objects,"
        " service.api.routes.listing, service.api.routes.meta;"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
