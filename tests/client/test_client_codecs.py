"""``service.client`` decodes every codec: objects stored through a real server and read
back with ``HsxClient`` and ``HsxTransfer`` are plain model-dtype states.

The engine runs with prefix caching off and the prompts one at a time, so the same
prompt run once per codec is computed the same way: its ``raw`` object is the exact
reference for the others (as in ``tests/engine/test_codecs_engine.py``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load

from service import codecs
from service.client import HsxClient, HsxTransfer
from tests.api.conftest import ServerThread
from tests.engine.conftest import engine_settings, random_prompts
from tests.engine.reference import reference_states

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The dense float32 model (every codec offered), local disk, no keys."""
    root = tmp_path_factory.mktemp("client-codecs")
    settings = engine_settings(
        model_dir("llama"), str(root), engine={"enable_prefix_caching": False}
    )
    thread = ServerThread(settings)
    thread.root = root  # type: ignore[attr-defined]
    thread.url = thread.serve(keys=None)  # type: ignore[attr-defined]
    yield thread
    thread.close()


def row_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative error and cosine per (token, layer)."""
    got, want = got.double(), want.double()
    relative = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return relative, torch.nn.functional.cosine_similarity(got, want, dim=-1)


def read_each_codec(client: HsxClient, prompt: list[int]) -> dict[str, tuple[str, Any]]:
    """The prompt stored once per codec: {codec: (key, tensors read by the client)}."""
    out = {}
    for codec in codecs.CODECS:
        answer = client.extract([prompt], codec=codec)
        assert answer["codecs"] == list(codecs.CODECS)
        (obj,) = answer["objects"]
        assert obj["codec"] == codec
        assert codecs.read_metadata(client.get_bytes(obj["key"]))["hsx.codec"] == codec
        out[codec] = (obj["key"], client.get(obj["key"]))
    return out


def test_client_reads_every_codec_as_model_dtype_states(server: Any) -> None:
    model, layers = server.settings.engine.model, server.extractor.layer_ids
    with HsxClient(server.url) as client:
        for prompt in random_prompts([17, 130], seed=71):
            objects = read_each_codec(client, prompt)
            raw = objects["raw"][1]["hidden_states"]
            assert raw.dtype == torch.float32
            assert raw.shape == (len(prompt), len(layers), 128)
            # raw itself is what transformers computes (the float32 reference).
            assert row_errors(raw, reference_states(model, prompt, layers))[0].max() <= 1e-5
            for codec, (key, tensors) in objects.items():
                assert set(tensors) == {"hidden_states", "token_ids"}, codec
                assert tensors["token_ids"].tolist() == prompt
                states = tensors["hidden_states"]
                assert states.dtype == torch.float32, codec
                assert states.shape == raw.shape
                assert torch.isfinite(states).all()
                decoded = client.get_bytes(key, decode=True)
                assert codecs.read_metadata(decoded)["hsx.codec"] == "raw"
                assert torch.equal(load(decoded)["hidden_states"], states)
            lossless = objects["lossless"][1]["hidden_states"]
            assert torch.equal(lossless.view(torch.int32), raw.view(torch.int32))  # bit for bit
            bf16 = objects["bf16"][1]["hidden_states"]
            assert torch.equal(bf16, raw.to(torch.bfloat16).float())
            relative, cosine = row_errors(objects["fp8"][1]["hidden_states"], raw)
            assert relative.max() <= 0.03, relative.max()
            assert cosine.min() >= 0.999, cosine.min()


def test_transfer_reads_fp8_objects_generated_and_cached(server: Any, tmp_path: Path) -> None:
    prompt = random_prompts([40], seed=72)[0]
    with HsxClient(server.url) as client:
        raw_key = client.extract([prompt], codec="raw")["objects"][0]["key"]
        raw = client.get(raw_key)["hidden_states"]
        fp8_key = client.extract([prompt], codec="fp8")["objects"][0]["key"]
    stored = server.root / fp8_key
    cache = tmp_path / "hidden_states"
    cache.mkdir()
    shutil.copy(stored, cache / "hs_0.safetensors")  # as generate-offline-data moves it
    transfer = HsxTransfer(server.url, cache_dir=cache)
    transfer.setup()
    cached = transfer.get_cached(0)
    generated = transfer.get_generated({"handle": fp8_key, "hidden_states_path": str(stored)})
    assert cached is not None
    assert generated is not None
    for tensors in (cached, generated):
        assert tensors["token_ids"].tolist() == prompt
        assert tensors["hidden_states"].dtype == torch.float32
        relative, _ = row_errors(tensors["hidden_states"], raw)
        assert relative.max() <= 0.03
    assert torch.equal(cached["hidden_states"], generated["hidden_states"])
    transfer.delete(str(stored))
    assert not stored.exists()
