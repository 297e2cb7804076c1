"""Inline answers (``return: "inline"``): the objects come back in the answer, and
nothing is written to storage.

On the engine (the dense model of tests/api): inline objects equal the stored objects
of the same prompts, the storage root is unchanged, the OpenAI routes carry each object
once in ``kv_transfer_params``, the client decodes it, an answer over
``limits.max_inline_bytes`` is refused before the engine runs, and what is answered
stays within the limit whatever the metadata (issue 58). On the fake: the other
refusals, among them the red team's shapes whose states fit but whose token ids,
positions, masks or headers do not.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from service import codecs
from tests.api.conftest import AUTH_A, KEY_A, ServerThread
from tests.engine.conftest import engine_requests, random_prompts

MIB = 1 << 20
#: A metadata value whose every character JSON-escapes to 6 bytes (``\u0001``), in
#: the request and in each object's header alike.
ESCAPED = "\x01" * 4096
#: An /extract answer's bytes besides its objects' base64: ids, shapes, statistics.
ANSWER_OVERHEAD = 16384
JSON = {**AUTH_A, "Content-Type": "application/json"}


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _extract(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = client.post("/extract", json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    return list(response.json()["objects"])


def _assert_same_object(inline: bytes, stored: bytes) -> None:
    """The same object: its metadata, its tensors (the states to float32 rounding: the
    two requests ran in different batches)."""
    mine, meta = codecs.decode(inline)
    theirs, stored_meta = codecs.decode(stored)
    assert meta == stored_meta
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"codec": "fp8", "tokens": "last"},
        {"tokens": "mean", "max_tokens": 3, "include_output_tokens": True, "loss": "all"},
    ],
    ids=["raw-all", "fp8-last", "mean-generated"],
)
def test_inline_objects_equal_the_stored_ones_and_nothing_is_written(
    client: httpx.Client, local_engine: ServerThread, options: dict[str, Any]
) -> None:
    root: Path = local_engine.root  # type: ignore[attr-defined]
    prompts = random_prompts([7, 33], seed=71)
    body = {"prompts": [{"token_ids": p} for p in prompts], **options}
    stored = _extract(client, body)
    before = _files(root)
    inline = _extract(client, {**body, "return": "inline"})
    assert _files(root) == before  # nothing written, not even a temporary file
    for mine, theirs in zip(inline, stored, strict=True):
        assert mine["uri"] == ""
        data = base64.b64decode(mine["data"])
        assert len(data) == mine["bytes"]
        assert hashlib.sha256(data).hexdigest() == mine["sha256"]
        assert (mine["num_tokens"], mine["shape"]) == (theirs["num_tokens"], theirs["shape"])
        assert client.get(f"/objects/{mine['key']}", headers=AUTH_A).status_code == 404
        _assert_same_object(data, client.get(f"/objects/{theirs['key']}", headers=AUTH_A).content)


@pytest.mark.engine
@pytest.mark.slow
def test_the_client_decodes_an_inline_object(local_url: str) -> None:
    from service.client import HsxClient

    prompt = random_prompts([12], seed=72)[0]
    with HsxClient(local_url, KEY_A) as client:
        answer = client.extract([prompt], tokens={"start": -4, "end": -1}, inline=True)
    (obj,) = answer.objects
    tensors = obj.tensors()
    assert tensors["hidden_states"].shape[0] == 3
    assert tensors["positions"].tolist() == [8, 9, 10]
    assert tensors["token_ids"].tolist() == prompt


@pytest.mark.engine
@pytest.mark.slow
def test_openai_inline_answers_carry_each_object_once(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    root: Path = local_engine.root  # type: ignore[attr-defined]
    model = client.get("/v1/models", headers=AUTH_A).json()["data"][0]["id"]
    prompts = random_prompts([10, 6], seed=73)
    before = _files(root)
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "return": "inline"}
    completion = _openai(client, "/v1/completions", {**body, "tokens": "last"})
    chat_body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    chat = _openai(client, "/v1/chat/completions", {**chat_body, "return": "inline"})
    assert _files(root) == before
    for answer, ids in ((completion, prompts), (chat, None)):
        answer_text, choices = answer.text, answer.json()["choices"]
        params = [c["kv_transfer_params"] for c in choices]
        for i, param in enumerate(params):
            assert answer_text.count(param["data"]) == 1  # once: in its choice
            tensors, meta = codecs.decode(base64.b64decode(param["data"]))
            assert list(tensors["hidden_states"].shape) == param["shape"]
            if ids is not None:
                assert tensors["token_ids"].tolist() == ids[i]
                assert param["shape"][0] == 1
                assert meta[codecs.TOKENS_KEY] == '"last"'
        # The top level names the first object, as vLLM's does, without its bytes.
        first = {k: v for k, v in params[0].items() if k != "data"}
        assert answer.json()["kv_transfer_params"] == first


def _openai(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    response = client.post(path, json=body, headers=AUTH_A)
    assert response.status_code == 200, response.text
    return response


@pytest.mark.engine
@pytest.mark.slow
def test_an_oversize_inline_request_is_refused_before_the_engine(
    local_engine: ServerThread,
) -> None:
    limit = 8192
    url = local_engine.serve(max_inline_bytes=limit)
    extractor = local_engine.extractor
    row = len(extractor.layer_ids) * extractor.info.hidden_size * 4  # float32
    tokens = limit // row + 1  # one token row more than fits
    with httpx.Client(base_url=url, timeout=120) as client:
        submitted = engine_requests()
        body = {"prompts": [{"token_ids": [5] * tokens}], "return": "inline"}
        response = client.post("/extract", json=body, headers=AUTH_A)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == "return"
        assert "max_inline_bytes" in error["message"]
        assert engine_requests() == submitted
        # The same prompt's last token fits.
        (obj,) = _extract(client, {**body, "tokens": "last"})
        assert obj["shape"][0] == 1
        assert obj["bytes"] <= limit
        assert engine_requests() > submitted


@pytest.mark.engine
@pytest.mark.slow
def test_a_metadata_heavy_inline_answer_stays_within_the_limit(
    local_engine: ServerThread,
) -> None:
    # The red team's "meta" shape: a ~1 MB body whose metadata each object's header
    # repeats (issue 58, M1: 8 objects of ~1 MB each were answered under a 1 MiB limit).
    url = local_engine.serve(max_inline_bytes=MIB, max_body_bytes=2 * MIB)
    metadata = {f"k{i:02d}": ESCAPED for i in range(40)}
    prompts = [{"token_ids": p} for p in random_prompts([16] * 8, seed=74)]
    body = {"prompts": prompts, "metadata": metadata, "tokens": "last", "return": "inline"}
    content = json.dumps(body).encode()
    assert 0.9 * MIB < len(content) < 1.1 * MIB
    with httpx.Client(base_url=url, headers=AUTH_A, timeout=120) as client:
        submitted = engine_requests()
        refused = client.post("/extract", content=content, headers=JSON)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["field"] == "return"
        assert engine_requests() == submitted
        # One such object fits: answered, base64 and all, within the limit's share.
        answer = client.post("/extract", json={**body, "prompts": prompts[:1]})
    assert answer.status_code == 200, answer.text
    assert len(answer.content) <= MIB * 4 // 3 + ANSWER_OVERHEAD
    (obj,) = answer.json()["objects"]
    data = base64.b64decode(obj["data"])
    assert MIB * 0.9 < len(data) <= MIB
    assert codecs.decode(data)[1]["k39"] == ESCAPED


@pytest.mark.engine
@pytest.mark.slow
def test_objects_of_different_sizes_each_get_their_share_of_the_limit(
    client: httpx.Client, local_engine: ServerThread
) -> None:
    # The limit holds the stored objects plus a header's slack each: an even split of
    # it would fail the long prompt, a split by size answers all three.
    body = {"prompts": [{"token_ids": p} for p in random_prompts([60, 4, 4], seed=75)]}
    sizes = [o["bytes"] for o in _extract(client, body)]
    limit = sum(sizes) + 3 * 1536
    assert sizes[0] > limit // 3
    url = local_engine.serve(max_inline_bytes=limit)
    with httpx.Client(base_url=url, timeout=120) as inline_client:
        objects = _extract(inline_client, {**body, "return": "inline"})
    assert [len(base64.b64decode(o["data"])) for o in objects] == sizes


# Refused before the engine, on the fake (float32, 3 layers of 8: 96 bytes a token row).
FAKE_LIMIT = 16384


def _ids(n: int) -> dict[str, list[int]]:
    return {"token_ids": [5] * n}


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("odd-value", {"return": "both"}, "return"),
    ("wrong-type", {"return": True}, "return"),
    (
        "with-custom-id",
        {"return": "inline", "prompts": [{"token_ids": [5, 6, 7], "custom_id": "a"}]},
        "return",
    ),
    ("too-large", {"return": "inline", "prompts": [{"token_ids": [5] * 200}]}, "return"),
    (
        "too-large-summed",
        {"return": "inline", "prompts": [{"token_ids": [5] * 100}, "a " * 80]},
        "return",
    ),
    (
        "too-large-with-generation",
        {
            "return": "inline",
            "prompts": [{"token_ids": [5] * 150}],
            "max_tokens": 64,
            "include_output_tokens": True,
        },
        "return",
    ),
    # The red team's "inline_max" shapes: states that fit just under the limit, and
    # token ids, positions or a loss mask that do not (issue 58, M1).
    ("states-fit-token-ids-do-not", {"return": "inline", "prompts": [_ids(170)]}, "return"),
    (
        "last-rows-fit-token-ids-do-not",
        {"return": "inline", "tokens": "last", "prompts": [_ids(300)] * 4},
        "return",
    ),
    (
        "window-fits-positions-and-mask-do-not",
        {
            "return": "inline",
            "tokens": {"start": 0, "end": 150},
            "loss": "all",
            "prompts": [_ids(150)],
        },
        "return",
    ),
    # Its "meta" shape, scaled to the fake's limit: each header repeats the metadata.
    (
        "metadata-in-every-header",
        {
            "return": "inline",
            "tokens": "last",
            "prompts": [_ids(3)] * 4,
            "metadata": {f"k{i}": ESCAPED[:300] for i in range(8)},
        },
        "return",
    ),
]


async def _post_to_fake(root: Path, fake: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    from tests.api.conftest import KEYS, fast_settings
    from tests.api.fake import serving_in_process

    settings = fast_settings(root, max_inline_bytes=FAKE_LIMIT)
    async with serving_in_process(settings, fake, KEYS) as (_, client):
        return await client.post(path, json=body, headers=AUTH_A)


@pytest.mark.parametrize(("extra", "field"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
async def test_bad_inline_requests_are_422_before_the_engine(
    tmp_path: Path, fake: Any, extra: dict[str, Any], field: str
) -> None:
    body = {"prompts": [{"token_ids": [5, 6, 7]}], **extra}
    response = await _post_to_fake(tmp_path, fake, "/extract", body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"].startswith(field), error
    assert fake.submitted == 0


async def test_an_inline_request_that_fits_is_let_through(tmp_path: Path, fake: Any) -> None:
    # 11520 bytes of states, 960 of token ids and a header of about 2 kB.
    body = {"prompts": [_ids(120)], "return": "inline"}
    response = await _post_to_fake(tmp_path, fake, "/extract", body)
    assert fake.submitted == 1, response.text


async def test_the_openai_routes_refuse_an_oversize_inline_answer_as_400(
    tmp_path: Path, fake: Any
) -> None:
    body = {"prompt": [5] * 200, "max_tokens": 1, "return": "inline"}  # the served model
    response = await _post_to_fake(tmp_path, fake, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "return"
    assert fake.submitted == 0
