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


def extract(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "prompts": [{"token_ids": prompt}],
        "max_tokens": GENERATED,
        "include_output_tokens": True,
    }
    answer = httpx.post(f"{url}/extract", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["objects"][0])


def check_concurrent(served: Served, model: Path, lengths: list[int], seed: int) -> None:
    """Prompts of ``lengths`` sent at once, each with its generated tokens stored: every
    layer of every object within 1e-5 of transformers' float32; nothing left running."""
    prompts = random_prompts(lengths, seed=seed)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        objects = list(pool.map(lambda p: extract(served.url, p), prompts))
    for prompt, obj in zip(prompts, objects, strict=True):
        data = (served.cwd / "var/objects" / obj["key"]).read_bytes()
        assert len(data) == obj["bytes"]
        stored_ids = load(data)["token_ids"].tolist()
        # The prompt, then the generated tokens but the last (never an input: no state).
        assert stored_ids[: len(prompt)] == prompt
        assert len(stored_ids) == len(prompt) + GENERATED - 1
        shape = SimpleNamespace(shape=tuple(obj["shape"]), num_tokens=obj["num_tokens"])
        assert_object_matches(data, str(model), stored_ids, LAYERS, shape)
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
    wrapped: tuple[Served, Path, str], request: pytest.FixtureRequest
) -> None:
    """A 1-token prompt and a 40-token one at once. On a Mamba hybrid served with hsx
    serve's defaults (a 2,048-token batch) the 1-token prompt's generated tokens come
    back 0.7-1.6 off float32 (Falcon-H1 here; Nemotron-H, through vLLM's own interface,
    the same), its prompt token exact; alone it is exact. Not hsx's class: marked until
    the hybrid path is fixed (strict: it fails the suite once it passes)."""
    served, model, family = wrapped
    if family == "falcon-h1":
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="1-token prompt beside another: hybrid decode")
        )
    check_concurrent(served, model, [1, 40], seed=82)


def _gauge(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in ``text``."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)
