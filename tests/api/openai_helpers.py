"""What the OpenAI-route tests share: counters read from /metrics, object checks."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import ServerThread, as_extraction
from tests.engine.checks import assert_object_matches


def counter(url: str, name: str) -> float:
    """The sum over all labels of a counter on ``url``'s /metrics (public route)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def served_name(engine: ServerThread) -> str:
    """The model name the server answers to (``/v1/models``): a local model's directory
    name, never its path."""
    from service.engine.builder import served_model_name

    return served_model_name(str(engine.extractor.info.name))


def engine_requests(url: str) -> float:
    """Requests the engine finished, whatever the reason (vLLM's own counter)."""
    return counter(url, "vllm:request_success_total")


def assert_durable(
    engine: ServerThread,
    client: httpx.Client,
    params: dict[str, Any],
    token_ids: list[int],
    headers: dict[str, str],
) -> None:
    """``kv_transfer_params`` name a complete object holding ``token_ids``' states."""
    key, path = params["handle"], Path(params["hidden_states_path"])
    assert path.is_absolute()
    assert path == engine.root / key  # type: ignore[attr-defined]
    data = path.read_bytes()
    assert len(data) == params["bytes"]
    assert hashlib.sha256(data).hexdigest() == params["sha256"]
    fetched = client.get(f"/objects/{key}", headers=headers)
    assert fetched.status_code == 200
    assert fetched.content == data
    model = engine.extractor.settings.engine.model
    layers = engine.extractor.layer_ids
    assert_object_matches(data, model, token_ids, layers, as_extraction(params))


def vllm_render(engine: ServerThread, **request: Any) -> list[int]:
    """Token ids from a direct call of vLLM's own chat renderer (``OnlineRenderer``,
    as ``vllm serve --enable-auto-tool-choice`` builds it) on the engine's model: the
    reference for hsx's render."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer

    llm = engine.extractor.engine
    renderer = OnlineRenderer(
        model_config=llm.model_config,
        renderer=llm.renderer,
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
        enable_auto_tools=True,
    )
    _, (rendered,) = engine.call(renderer.render_chat(ChatCompletionRequest(**request)))
    return list(rendered["prompt_token_ids"])


def wait_until_idle(engine: ServerThread, limit_s: float = 10) -> float:
    """Seconds until the engine has no request left (fails past ``limit_s``)."""
    start = time.monotonic()
    while engine.unfinished():
        assert time.monotonic() - start < limit_s, "engine requests were not aborted"
        time.sleep(0.02)
    return time.monotonic() - start
