"""Falcon-H1 and Gemma 3, whose vLLM classes lack EAGLE-3's aux-hidden-state interface,
served by the ``hsx serve`` command as a user starts it (the model, its layer ids and
float32; nothing else): hsx's subclasses (service/engine/models.py), registered in the
engine's own processes, give the states exactly as transformers computes them.

Falcon-H1 runs Mamba2 and attention side by side in each layer (a hybrid: its own KV
cache groups); Gemma 3 alternates sliding-window (16 tokens here) and global attention.
One server per family, one at a time (the module fixture is parametrized).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from safetensors.torch import load

from tests.engine.checks import assert_object_matches
from tests.engine.conftest import random_prompts
from tests.support.processes import Served, hsx_serve

pytestmark = [pytest.mark.engine, pytest.mark.slow]
LAYERS = [0, 1, 2, 3, 4]
GENERATED = 4


@pytest.fixture(scope="module", params=["falcon-h1", "gemma3"])
def wrapped(
    request: pytest.FixtureRequest, model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, Path, str]]:
    cwd = tmp_path_factory.mktemp(f"{request.param}-serve")
    model = model_dir(request.param)
    # What a user passes: float32, since "auto" serves a float32 config in bfloat16 on CPU.
    env = {
        "HSX_ENGINE__MODEL": str(model),
        "HSX_ENGINE__LAYER_IDS": json.dumps(LAYERS),
        "HSX_ENGINE__DTYPE": "float32",
    }
    with hsx_serve(cwd, env) as served:
        yield served, model, request.param


def extract(url: str, prompt: list[int], max_tokens: int = GENERATED) -> dict[str, Any]:
    body = {
        "prompts": [{"token_ids": prompt}],
        "max_tokens": max_tokens,
        "include_output_tokens": True,
    }
    answer = httpx.post(f"{url}/extract", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["objects"][0])


def check_object(
    served: Served, model: Path, prompt: list[int], obj: dict[str, Any], generated: int
) -> None:
    """The stored object of ``prompt`` with its ``generated`` tokens: every layer within
    1e-5 of transformers' float32 on the same token ids."""
    data = (served.cwd / "var/objects" / obj["key"]).read_bytes()
    assert len(data) == obj["bytes"]
    stored_ids = load(data)["token_ids"].tolist()
    # The prompt, then the generated tokens but the last (never an input: no state).
    assert stored_ids[: len(prompt)] == prompt
    assert len(stored_ids) == len(prompt) + generated - 1
    shape = SimpleNamespace(shape=tuple(obj["shape"]), num_tokens=obj["num_tokens"])
    assert_object_matches(data, str(model), stored_ids, LAYERS, shape)


def check_concurrent(served: Served, model: Path, lengths: list[int], seed: int) -> None:
    """Prompts of ``lengths`` sent at once, each with its generated tokens stored: every
    layer of every object within 1e-5 of transformers' float32; nothing left running."""
    prompts = random_prompts(lengths, seed=seed)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        objects = list(pool.map(lambda p: extract(served.url, p), prompts))
    for prompt, obj in zip(prompts, objects, strict=True):
        check_object(served, model, prompt, obj, GENERATED)
    assert_nothing_running(served)


def assert_nothing_running(served: Served) -> None:
    metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
    assert _gauge(metrics, "vllm:num_requests_running") == 0
    assert _gauge(metrics, "vllm:num_requests_waiting") == 0


def test_concurrent_prompts_and_output_tokens_match_transformers(
    wrapped: tuple[Served, Path, str],
) -> None:
    """Prompts of 2-129 tokens at once (Gemma 3's 16-token window far behind most)."""
    served, model, _family = wrapped
    check_concurrent(served, model, [2, 5, 17, 40, 64, 65, 100, 129], seed=81)
    # hsx's class served it, eagerly (its hooks would not run in a compiled forward).
    output = served.output()
    assert "enforce_eager=True" in output, output[-3000:]


def test_a_one_token_prompt_beside_another_matches_transformers(
    wrapped: tuple[Served, Path, str],
) -> None:
    """A 1-token prompt and a 40-token one at once, through HTTP."""
    served, model, _family = wrapped
    check_concurrent(served, model, [1, 40], seed=82)


def test_a_one_token_prompt_sent_while_another_decodes_matches_transformers(
    wrapped: tuple[Served, Path, str],
) -> None:
    """A 1-token prompt sent once a 40-token one has generated a token (vLLM's own
    ``vllm:generation_tokens`` counter), while it decodes. vLLM pads such a prompt with
    a placeholder draft, and on Falcon-H1 the Mamba prefill of that row stored the
    placeholder's state: the 1-token prompt's generated tokens came back 2e-3 to 4e-3
    off (once NaN), its prompt token exact, until
    service/engine/vllm_patches/mamba_padding.py."""
    served, model, _family = wrapped
    long, short = random_prompts([40, 1], seed=84)

    def generated_tokens() -> float:
        metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
        return _gauge(metrics, "vllm:generation_tokens_total")

    before = generated_tokens()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(extract, served.url, long, 64)
        deadline = time.monotonic() + 120
        while generated_tokens() == before and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the counter: no event tells a client sooner
        assert generated_tokens() > before, "the 40-token prompt never started decoding"
        obj = extract(served.url, short)
        assert not decoding.done(), "the 1-token prompt did not run beside a decoding one"
        long_obj = decoding.result()
    check_object(served, model, short, obj, GENERATED)
    # It may stop early (end of sequence): its object says how many it stored.
    check_object(served, model, long, long_obj, long_obj["num_tokens"] - len(long) + 1)
    assert_nothing_running(served)


def _gauge(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in ``text``."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)
