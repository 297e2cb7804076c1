"""Token selection (``tokens``): which stored positions an object keeps.

On the engine (the dense model of tests/api; the hybrid's are in
tests/engine/test_hybrid_s3.py, through :func:`check_selected`): ``last``, ``mean``,
``mean_loss`` and a window equal the matching rows (and means) of the same prompts'
``tokens: "all"`` objects, prompt-only and with generated tokens, for every codec.
On the fake: the refusals, before any engine request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from service import codecs
from tests.api.conftest import AUTH_A, Served
from tests.engine.conftest import random_prompts

#: What each selection is checked with; a window with a negative end.
SELECTIONS: list[Any] = ["last", "mean", "mean_loss", {"start": 1, "end": -1}]
#: How close a codec's states come to the model's (relative L2 per row); 0: exact.
CODEC_BOUND = {"raw": 0.0, "lossless": 0.0, "bf16": 0.005, "fp8": 0.03}


def expected_rows(
    selection: Any, states: torch.Tensor, num_prompt: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, rows) a selection keeps of an ``all`` object's ``states`` [T, L, H]."""
    stored = states.shape[0]
    if selection == "last":
        positions = torch.tensor([stored - 1])
    elif selection == "mean":
        positions = torch.arange(num_prompt)
    elif selection == "mean_loss":
        assert mask is not None
        positions = torch.nonzero(mask).flatten()
    else:
        positions = torch.arange(stored)[selection["start"] : selection["end"]]
    rows = states[positions].to(torch.float32)
    if selection in ("mean", "mean_loss"):
        # Summed in float32, stored in the states' dtype (connector/copyout.py's pool):
        # a bfloat16 model's mean is rounded to bfloat16 once.
        rows = rows.sum(dim=0, keepdim=True) / rows.shape[0]
        rows = rows.to(states.dtype).to(torch.float32)
    return positions, rows


def check_selected(
    selection: Any, codec: str, full: bytes, selected: bytes, num_prompt: int
) -> None:
    """``selected`` (an object under ``selection`` and ``codec``) holds the rows, or the
    mean, of the same prompt's ``full`` raw ``tokens: "all"`` object."""
    everything, _ = codecs.decode(full)
    tensors, metadata = codecs.decode(selected)
    assert torch.equal(tensors["token_ids"], everything["token_ids"])  # the stored sequence
    assert json.loads(metadata[codecs.TOKENS_KEY]) == selection
    positions, rows = expected_rows(
        selection, everything["hidden_states"], num_prompt, everything.get("loss_mask")
    )
    assert torch.equal(tensors["positions"], positions)
    states = tensors["hidden_states"].to(torch.float32)
    assert states.shape == (rows.shape[0], *everything["hidden_states"].shape[1:])
    bound = CODEC_BOUND[codec]
    if bound == 0.0:
        torch.testing.assert_close(states, rows, rtol=1e-5, atol=1e-5)
    else:
        relative = (states - rows).norm(dim=-1) / rows.norm(dim=-1)
        assert relative.max() <= bound


def _extract(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _get(client: httpx.Client, key: str) -> bytes:
    return client.get(f"/objects/{key}", headers=AUTH_A).content


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("codec", list(CODEC_BOUND))
@pytest.mark.parametrize("generated", [False, True], ids=["prompt", "generated"])
def test_selections_are_rows_of_the_full_states(
    client: httpx.Client, codec: str, generated: bool
) -> None:
    prompts = random_prompts([9, 40], seed=61)
    base: dict[str, Any] = {"prompts": [{"token_ids": p} for p in prompts], "loss": "all"}
    if generated:
        base |= {"max_tokens": 4, "include_output_tokens": True}
    full = _extract(client, base)["objects"]
    for selection in SELECTIONS:
        data = _extract(client, {**base, "tokens": selection, "codec": codec})
        for prompt, whole, obj in zip(prompts, full, data["objects"], strict=True):
            assert obj["num_tokens"] == whole["num_tokens"]  # the stored sequence's
            rows = 1 if selection in ("mean", "mean_loss", "last") else whole["num_tokens"] - 2
            assert obj["shape"] == [rows, *whole["shape"][1:]]
            selected = _get(client, obj["key"])
            assert len(selected) == obj["bytes"]
            check_selected(selection, codec, _get(client, whole["key"]), selected, len(prompt))


@pytest.mark.engine
@pytest.mark.slow
def test_mean_loss_averages_the_assistant_tokens_only(client: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sea."},
    ]
    base = {"prompts": [{"messages": messages}], "loss": "assistant"}
    (whole,) = _extract(client, base)["objects"]
    (obj,) = _extract(client, {**base, "tokens": "mean_loss"})["objects"]
    full = _get(client, whole["key"])
    mask = codecs.decode(full)[0]["loss_mask"]
    assert 0 < int(mask.sum()) < whole["num_tokens"]
    check_selected("mean_loss", "raw", full, _get(client, obj["key"]), whole["num_tokens"])


@pytest.mark.engine
@pytest.mark.slow
def test_selection_statistics_are_of_the_stored_rows(client: httpx.Client) -> None:
    (prompt,) = random_prompts([30], seed=62)
    (obj,) = _extract(client, {"prompts": [{"token_ids": prompt}], "tokens": "last"})["objects"]
    assert obj["statistics"]["num_tokens"] == 1
    states = codecs.decode(_get(client, obj["key"]))[0]["hidden_states"].to(torch.float64)
    sums = states.sum(dim=(0, 2)).tolist()
    assert obj["statistics"]["sum"] == pytest.approx(sums, rel=1e-9, abs=1e-9)


# Refused before the engine (the fake's: prompt of 3 tokens, max_tokens up to 64).
NOT_INT = "Input should be a valid integer"
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("empty-window", {"tokens": {"start": 2, "end": 2}}, "is empty"),
    ("reversed-window", {"tokens": {"start": 2, "end": 1}}, "is empty or outside"),
    ("past-the-end", {"tokens": {"start": 0, "end": 4}}, "outside the 3 stored"),
    ("before-the-start", {"tokens": {"start": -4, "end": -1}}, "outside the 3 stored"),
    (
        "past-the-generation",
        {"tokens": {"start": 0, "end": 6}, "max_tokens": 3, "include_output_tokens": True},
        "outside the 5 stored",
    ),
    ("mean-loss-without-loss", {"tokens": "mean_loss"}, "set loss"),
    ("wrong-type", {"tokens": 3}, "or a window object"),
    ("odd-value", {"tokens": "first"}, "or a window object"),
    # A window's own errors name its field (issue 58, L7), never the named choices.
    ("string-index", {"tokens": {"start": "0", "end": 2}}, f"tokens.start: {NOT_INT}"),
    ("bool-index", {"tokens": {"start": True, "end": 2}}, f"tokens.start: {NOT_INT}"),
    ("float-index", {"tokens": {"start": 0.0, "end": 2}}, f"tokens.start: {NOT_INT}"),
    ("huge-int", {"tokens": {"start": 0, "end": 10**30}}, "tokens.end: Input should be less"),
    ("missing-end", {"tokens": {"start": 0}}, "tokens.end: Field required"),
    ("extra-key", {"tokens": {"start": 0, "end": 1, "step": 2}}, "tokens.step: Extra inputs"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "text"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_bad_selections_are_422_naming_tokens_before_the_engine(
    fake_client: httpx.Client, fake_served: Served, extra: dict[str, Any], text: str
) -> None:
    submitted = fake_served.engine_requests()
    body = {"prompts": [{"token_ids": [5, 6, 7]}], **extra}
    response = fake_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert error["message"].startswith(f"{error['field']}: "), error
    assert error["field"].startswith("tokens"), error
    assert text in error["message"]
    assert fake_served.engine_requests() == submitted


def test_a_mistyped_window_is_422_naming_its_field(
    fake_client: httpx.Client, fake_served: Served
) -> None:
    body = {"prompts": [{"token_ids": [5, 6, 7]}], "tokens": {"start": 0.0, "end": 2}}
    response = fake_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == {
        "type": "invalid_request",
        "message": "tokens.start: Input should be a valid integer",
        "field": "tokens.start",
    }
    window = {"start": 0, "end": 2.5}
    completion = {"model": fake_served.name, "prompt": [5, 6, 7], "tokens": window}
    response = fake_client.post("/v1/completions", json=completion, headers=AUTH_A)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (
        "tokens.end",
        "tokens.end: Input should be a valid integer",
    )


def test_a_text_prompt_is_checked_once_tokenised(
    fake_client: httpx.Client, fake_served: Served
) -> None:
    submitted = fake_served.engine_requests()
    body = {"prompts": ["one two", {"token_ids": [5] * 50}], "tokens": {"start": 40, "end": 45}}
    response = fake_client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["field"], error["index"]) == ("tokens", 0)
    assert fake_served.engine_requests() == submitted


def test_the_openai_routes_refuse_a_bad_selection_as_400(
    fake_client: httpx.Client, fake_served: Served
) -> None:
    submitted = fake_served.engine_requests()
    body = {"model": fake_served.name, "prompt": [5, 6, 7], "tokens": {"start": -9, "end": -1}}
    response = fake_client.post("/v1/completions", json=body, headers=AUTH_A)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tokens"
    body = {"model": fake_served.name, "prompt": [5, 6, 7], "tokens": "mean_loss"}
    response = fake_client.post("/v1/completions", json=body, headers=AUTH_A)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tokens"
    assert fake_served.engine_requests() == submitted


# The worker's side, without an engine: positions and the mean's accumulation.
@pytest.mark.parametrize(
    ("tokens", "prompt", "stored", "spans", "positions"),
    [
        ("all", 5, 5, None, None),
        ("last", 5, 5, None, (4,)),
        ("last", 5, 8, None, (7,)),  # with generated tokens: the last stored one
        ("mean", 5, 8, None, (0, 1, 2, 3, 4)),  # the prompt's only
        ("mean_loss", 5, 8, [(1, 3), (5, 8)], (1, 2, 5, 6, 7)),
        ({"start": -3, "end": -1}, 5, 8, None, (5, 6)),
        ({"start": 1, "end": 8}, 5, 8, None, tuple(range(1, 8))),
    ],
)
def test_selected_positions(
    tokens: Any, prompt: int, stored: int, spans: Any, positions: Any
) -> None:
    from service.engine.wire import RequestParams, selected_positions

    selection = RequestParams(key="k", tokens=tokens).tokens
    assert selected_positions(selection, prompt, stored, spans) == positions


def test_a_mean_accumulates_in_float32_and_keeps_the_model_dtype() -> None:
    from service.engine.connector.copyout import pool
    from service.engine.jobs import PendingSave

    save = PendingSave("r", "k", tuple(range(4096)), (0,), {}, positions=None, pooled=True)
    states = torch.full((4096, 2, 8), 1.001, dtype=torch.bfloat16)
    mean = pool(states, save)
    assert mean.shape == (1, 2, 8)
    assert mean.dtype == torch.bfloat16
    assert torch.equal(mean, states[:1])  # a bfloat16 running sum would have stalled
    assert pool(states, PendingSave("r", "k", (1,), (0,), {})) is states
