"""Every codec through the real engine and storage, on the dense and the hybrid model.

Each engine runs with prefix caching off and each prompt alone, so the same prompt run
twice is computed the same way: the ``raw`` object is then the exact reference for the
others (a cached prefix would be read back and the rest recomputed in a smaller batch).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load

from service import codecs
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_requests, engine_settings, random_prompts, running

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LENGTHS = [1, 17, 100, 257]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["llama", "nemotron-h"])
async def engine(request: Any, model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One engine at a time: pytest finishes every test of one param before the next."""
    root = tmp_path_factory.mktemp("codec-objects")
    settings = engine_settings(
        model_dir(request.param), str(root), engine={"enable_prefix_caching": False}
    )
    async with running(settings) as extractor:
        extractor.test_root = root
        yield extractor


def stored(engine: Any, result: Any) -> bytes:
    """The object's bytes as storage holds them, checked against what the engine said."""
    data = (engine.test_root / result.key).read_bytes()
    assert len(data) == result.size
    assert hashlib.sha256(data).hexdigest() == result.sha256
    return data


def row_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    got, want = got.double(), want.double()
    relative = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return relative, torch.nn.functional.cosine_similarity(got, want, dim=-1)


async def extract_each_codec(engine: Any, prompt: list[int]) -> dict[str, tuple[Any, bytes]]:
    """The same prompt alone, once per codec: {codec: (extraction, stored bytes)}."""
    out = {}
    for codec in codecs.CODECS:
        result = await engine.extract(prompt, engine.request_params("codecs", codec=codec))
        assert result.codec == codec
        out[codec] = (result, stored(engine, result))
    return out


async def test_every_codec_round_trips_through_storage(engine: Any) -> None:
    model, layers = engine.settings.engine.model, engine.layer_ids
    for prompt in random_prompts(LENGTHS, seed=11):
        objects = await extract_each_codec(engine, prompt)
        raw_result, raw_bytes = objects["raw"]
        assert_object_matches(raw_bytes, model, prompt, layers, raw_result)
        reference = load(raw_bytes)["hidden_states"]
        for codec, (result, data) in objects.items():
            tensors, meta = codecs.decode(data)
            assert meta["hsx.codec"] == codec
            assert meta["layer_ids"] == json.dumps(layers)
            assert tensors["token_ids"].tolist() == prompt
            assert tensors["hidden_states"].dtype == reference.dtype == torch.float32
            assert result.shape == tuple(reference.shape) == (len(prompt), len(layers), 128)
            assert load(codecs.to_raw(data))["hidden_states"].shape == reference.shape
        check_codecs_against_raw(reference, objects)


def check_codecs_against_raw(reference: torch.Tensor, objects: dict[str, Any]) -> None:
    """What each codec promises, against the same prompt's float32 ``raw`` states."""
    lossless, _ = codecs.decode(objects["lossless"][1])
    assert torch.equal(
        lossless["hidden_states"].view(torch.int32), reference.view(torch.int32)
    )  # bit for bit
    assert torch.equal(load(codecs.to_raw(objects["lossless"][1]))["hidden_states"], reference)
    bf16 = load(objects["bf16"][1])["hidden_states"]
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, reference.to(torch.bfloat16))
    fp8, _ = codecs.decode(objects["fp8"][1])
    assert torch.isfinite(fp8["hidden_states"]).all()
    relative, cosine = row_errors(fp8["hidden_states"], reference)
    assert relative.max() <= 0.03, relative.max()
    assert cosine.min() >= 0.999, cosine.min()
    if reference.shape[0] < 100:
        return  # the header outweighs the states of short prompts
    sizes = {codec: result.size for codec, (result, _) in objects.items()}
    assert sizes["bf16"] < 0.55 * sizes["raw"]
    assert sizes["fp8"] < 0.30 * sizes["raw"]  # a quarter of float32, plus the scales
    assert sizes["lossless"] < sizes["raw"]


async def test_layer_subset_holds_only_those_layers(engine: Any) -> None:
    prompt = random_prompts([90], seed=12)[0]
    full = await engine.extract(prompt, engine.request_params("codecs"))
    everything = load(stored(engine, full))["hidden_states"]
    subset = engine.layer_ids[1:]  # e.g. EAGLE-1 / MTP heads want one or a few
    one = [engine.layer_ids[-1]]
    for layers in (subset, one):
        result = await engine.extract(prompt, engine.request_params("codecs", layers=layers))
        data = stored(engine, result)
        states = load(data)["hidden_states"]
        index = [engine.layer_ids.index(i) for i in layers]
        assert result.layer_ids == tuple(layers)
        assert result.shape == (90, len(layers), 128)
        assert torch.equal(states, everything[:, index])
        assert codecs.read_metadata(data)["layer_ids"] == json.dumps(layers)
        assert result.size < full.size * (len(layers) + 0.5) / len(engine.layer_ids)
    result = await engine.extract(prompt, engine.request_params("codecs", layers=one, codec="fp8"))
    fp8, _ = codecs.decode(stored(engine, result))
    relative, _ = row_errors(fp8["hidden_states"], everything[:, -1:])
    assert relative.max() <= 0.03


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"codec": "zfp"}, "choose one of " + ", ".join(codecs.CODECS)),
        ({"layers": [3]}, "not a non-empty subset of the served layer ids"),
        ({"layers": []}, "not a non-empty subset"),
    ],
)
async def test_bad_codec_or_layers_never_reach_the_engine(
    engine: Any, kwargs: dict[str, Any], message: str
) -> None:
    before = engine_requests()
    with pytest.raises(ValueError, match=message):
        await engine.extract([5, 6, 7], engine.request_params("codecs", **kwargs))
    assert engine_requests() == before
    reversed_layers = list(reversed(engine.layer_ids))
    with pytest.raises(ValueError, match="in that order"):
        await engine.extract([5, 6, 7], engine.request_params("codecs", layers=reversed_layers))
    assert engine_requests() == before


async def test_speculators_arrow_dataset_reads_hsx_fp8_objects(engine: Any, tmp_path: Path) -> None:
    """A trainer's dataset of hsx fp8 objects, read by speculators through FP8Transfer."""
    data_module = pytest.importorskip(
        "speculators.train.data",
        reason="speculators is not installed in this environment (pip install speculators)",
    )
    from datasets import Dataset
    from hs_connectors import FP8Transfer

    prompts = random_prompts([12, 40, 75], seed=13)
    (tmp_path / "hidden_states").mkdir()
    references = []
    for i, prompt in enumerate(prompts):
        raw = await engine.extract(prompt, engine.request_params("codecs"))
        references.append(load(stored(engine, raw))["hidden_states"])
        fp8 = await engine.extract(prompt, engine.request_params("codecs", codec="fp8"))
        (tmp_path / "hidden_states" / f"hs_{i}.safetensors").write_bytes(stored(engine, fp8))
    Dataset.from_dict(
        {
            "input_ids": prompts,
            "loss_mask": [[1] * len(p) for p in prompts],
            "seq_len": [len(p) for p in prompts],
        }
    ).with_format("torch").save_to_disk(tmp_path / "data")
    dataset = data_module.ArrowDataset(
        max_len=512,
        datapath=tmp_path / "data",
        transfer=FP8Transfer(tmp_path / "hidden_states"),
        on_missing="raise",
    )
    assert len(dataset) == len(prompts)
    for i, reference in enumerate(references):
        sample = dataset[i]
        assert sample["input_ids"].tolist() == prompts[i]
        relative, _ = row_errors(sample["verifier_last_hidden_states"], reference[:, -1])
        assert relative.max() <= 0.03
        aux = sample["hidden_states"].view(len(prompts[i]), -1, reference.shape[-1])
        relative, _ = row_errors(aux, reference[:, :-1])
        assert relative.max() <= 0.03
