"""The codec registry: a codec is one registered class, and whatever names the codecs
(the ``Codec`` type, the settings and request fields, descriptions, the readers)
follows the registry."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import get_args

import pytest
import torch
from pydantic import BaseModel, ValidationError

from service import codecs
from service.codecs import CODECS, CodecImpl, Shape, TensorCheck
from service.config import StorageSettings
from service.engine.wire import RequestParams

KEY = "hsx/team/2026/01/01/" + "a" * 32 + ".safetensors"


def test_every_codec_is_one_registered_instance_under_its_name() -> None:
    assert next(iter(CODECS)) == "raw"  # listed first: the default
    for name, impl in CODECS.items():
        assert isinstance(impl, CodecImpl)
        assert impl.name == name
        assert impl.summary
        assert codecs.codec_impl(name) is impl


def test_an_unknown_codec_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="choose one of " + ", ".join(CODECS)):
        codecs.codec_impl("zfp")


@pytest.mark.parametrize(
    ("model", "field"), [(RequestParams, "codec"), (StorageSettings, "codec")], ids=str
)
def test_pydantic_fields_of_the_codec_type_follow_the_registry(
    model: type[BaseModel], field: str
) -> None:
    assert get_args(codecs.Codec) == tuple(CODECS)
    schema = model.model_json_schema()["properties"][field]
    assert schema["enum"] == list(CODECS)
    names = ", ".join(f"'{name}'" for name in list(CODECS)[:-1]) + f" or '{list(CODECS)[-1]}'"
    extra = {"key": KEY} if model is RequestParams else {}
    with pytest.raises(ValidationError, match=names):
        model.model_validate({**extra, field: "zfp"})
    for name in CODECS:
        assert getattr(model.model_validate({**extra, field: name}), field) == name


def test_descriptions_name_every_codec() -> None:
    text = codecs.describe()
    assert all(f"`{name}` ({impl.summary})" in text for name, impl in CODECS.items())
    assert text in (StorageSettings.model_fields["codec"].description or "")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_restore_gives_back_the_states_prepare_was_given(codec: str, dtype: torch.dtype) -> None:
    states = torch.randn(9, 2, 64).to(dtype)
    restored = codecs.restore(codec, codecs.prepare(codec, states))
    assert restored.shape == states.shape
    error = (restored.double() - states.double()).norm() / states.double().norm()
    assert error < 0.03  # exact for raw and lossless, a cast for bf16, fp8's bound


# ==============================
# A codec added in a test: one class, registered, is read and written everywhere
# ==============================


class HalfCodec(CodecImpl):
    """float16 states: a codec made for this test only."""

    name = "half-test"
    summary = "float16"

    def offered_for(self, model_dtype: str) -> bool:
        return model_dtype == "float32"

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden_states": states.to(torch.float16)}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        tokens, layers, hidden = shape
        return tokens * layers * hidden * 2

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        return list(tensor("hidden_states", ["F16"], 3))

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return tensors["hidden_states"].to(dtype)


@pytest.fixture
def half() -> Iterator[str]:
    codecs.register(HalfCodec)
    try:
        yield HalfCodec.name
    finally:
        del CODECS[HalfCodec.name]


def test_a_registered_class_is_a_codec_for_every_function(half: str) -> None:
    assert half in codecs.offered("float32")
    assert half not in codecs.offered("bfloat16")
    assert codecs.check_codec(half, "float32") == half
    assert f"`{half}` (float16)" in codecs.describe()
    states = torch.randn(7, 3, 16)
    prepared = codecs.prepare(half, states)
    assert codecs.prepared_nbytes(half, (7, 3, 16), torch.float32) == sum(
        t.numel() * t.element_size() for t in prepared.values()
    )
    meta = {"dtype": "float32", "layer_ids": "[1, 2, 3]"}
    data = b"".join(codecs.pack_parts(half, prepared, torch.arange(7), meta))
    header = codecs.read_object(data)
    assert (header.codec, header.shape, header.layer_ids) == (half, (7, 3, 16), (1, 2, 3))
    tensors, metadata = codecs.decode(data)
    assert metadata[codecs.CODEC_KEY] == half
    assert tensors["hidden_states"].dtype == torch.float32
    assert torch.equal(tensors["hidden_states"], states.to(torch.float16).float())
    raw = codecs.decode(codecs.to_raw(data))
    assert raw[1][codecs.DECODED_FROM_KEY] == half
    assert torch.equal(raw[0]["hidden_states"], tensors["hidden_states"])


def test_a_registered_codec_checks_its_objects_tensors(half: str) -> None:
    meta = {"dtype": "float32"}
    wrong = {"hidden_states": torch.zeros(2, 1, 4)}  # float32 where float16 is written
    data = b"".join(codecs.pack_parts(half, wrong, torch.arange(2), meta))
    with pytest.raises(codecs.CorruptObjectError, match=f"{half} writes F16"):
        codecs.read_object(data)


def test_read_tensor_views_one_tensor_of_an_object() -> None:
    states = torch.randn(5, 2, 8)
    mask = torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8)
    meta = {"dtype": "float32"}
    ids = torch.arange(5) * 3
    data = b"".join(
        codecs.pack_parts("raw", {"hidden_states": states}, ids, meta, {"loss_mask": mask})
    )
    header = codecs.read_object(data)
    assert codecs.read_tensor(data, header, "token_ids").tolist() == ids.tolist()
    assert codecs.read_tensor(data, header, "loss_mask").tolist() == mask.tolist()
    assert (codecs.read_tensor(data, header, "hidden_states") == states.numpy()).all()
    fp8 = b"".join(codecs.pack_parts("fp8", codecs.prepare("fp8", states), ids, meta))
    with pytest.raises(ValueError, match="numpy has no dtype"):
        codecs.read_tensor(fp8, codecs.read_object(fp8), "hidden_states")
