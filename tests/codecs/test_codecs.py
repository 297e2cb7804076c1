"""The object codecs without an engine: round trips, exactness, fp8 error bounds, readers."""

from __future__ import annotations

import asyncio
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load, save

from service import codecs
from service.storage import Data
from tests.engine.faulty import FaultyStorage

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def states(tokens: int = 37, layers: int = 3, hidden: int = 128, seed: int = 0) -> torch.Tensor:
    """float32 states with a different scale per layer, as a residual stream grows."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 1.0, 30.0][:layers] + [3.0] * max(0, layers - 3))
    return torch.randn(tokens, layers, hidden, generator=gen) * scale[None, :, None]


def ids(tokens: int) -> torch.Tensor:
    return torch.arange(tokens, dtype=torch.int64) * 7 + 3


def encode(
    codec: codecs.Codec,
    states: torch.Tensor,
    token_ids: torch.Tensor,
    metadata: dict[str, str] | None = None,
) -> bytes:
    """One object's bytes, made as the writer makes them on the CPU: ``prepare``, then
    ``pack_parts`` joined."""
    meta = {**(metadata or {}), "dtype": codecs.dtype_name(states.dtype)}
    return b"".join(codecs.pack_parts(codec, codecs.prepare(codec, states), token_ids, meta))


def row_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative error and cosine similarity per (token, layer), in float32."""
    got, want = got.double(), want.double()  # float32 norms overflow on 1e30 outliers
    relative = (got - want).norm(dim=-1) / want.norm(dim=-1)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    return relative, cosine


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", codecs.CODECS)
def test_every_codec_round_trips_shape_dtype_ids_and_metadata(
    codec: codecs.Codec, dtype: torch.dtype
) -> None:
    x = states().to(dtype)
    data = encode(codec, x, ids(37), {"model": "m", "run": "r1"})
    tensors, meta = codecs.decode(data)
    assert tensors["hidden_states"].shape == (37, 3, 128)
    assert tensors["hidden_states"].dtype == dtype
    assert tensors["token_ids"].dtype == torch.int64
    assert tensors["token_ids"].tolist() == ids(37).tolist()
    assert meta["hsx.codec"] == codec
    assert meta["hsx.codec_version"] == codecs.CODEC_VERSION
    assert meta["dtype"] == codecs.dtype_name(dtype)
    assert (meta["model"], meta["run"]) == ("m", "r1")


def test_raw_is_the_example_connector_layout() -> None:
    x = states()
    tensors = load(encode("raw", x, ids(37)))
    assert set(tensors) == {"hidden_states", "token_ids"}
    assert torch.equal(tensors["hidden_states"], x)


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_pack_parts_are_the_safetensors_file_of_the_same_tensors(codec: codecs.Codec) -> None:
    # What the writer stores: the header and each tensor's own memory, one after another.
    x = states()
    mask = torch.tensor([0, 1] * 18 + [1], dtype=torch.uint8)
    meta = {"dtype": "float32", "model": "m", "note": 'quote " back\\slash\n\x01 é'}
    prepared = codecs.prepare(codec, x)
    parts = codecs.pack_parts(codec, prepared, ids(37), meta, {"loss_mask": mask})
    data = b"".join(parts)
    tensors, stored = codecs.decode(data)
    assert codecs.read_metadata(data) == stored
    assert {k: stored[k] for k in meta} == meta
    assert torch.equal(tensors["token_ids"], ids(37))
    assert torch.equal(tensors["loss_mask"], mask)
    assert torch.equal(
        tensors["hidden_states"],
        codecs.decode(encode(codec, x, ids(37)))[0]["hidden_states"],
    )
    # safetensors' own writer gives the same bytes (one metadata key: it orders keys
    # differently from run to run, we sort them).
    one = {"dtype": "float32"}
    packed = {n: t.contiguous() for n, t in prepared.items()}
    if codec == "lossless":
        packed = codecs.split_planes(x)
    full = {**one, "hsx.codec": codec, "hsx.codec_version": codecs.CODEC_VERSION}
    ours = b"".join(
        codecs.safetensors_parts({**packed, "token_ids": ids(37)}, {"dtype": "float32"})
    )
    assert ours == save({**packed, "token_ids": ids(37)}, metadata=one)
    assert codecs.read_metadata(b"".join(codecs.pack_parts(codec, prepared, ids(37), one))) == full


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_is_bit_identical_on_any_bit_pattern(dtype: torch.dtype) -> None:
    """Random bits cover NaN payloads, infinities, subnormals and -0.0."""
    info = torch.iinfo(BITS[dtype])
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(info.min, info.max, (29, 4, 96), generator=gen, dtype=BITS[dtype])
    bits[0, 0, :4] = torch.tensor([0, info.min, 1, -1], dtype=BITS[dtype])  # 0, -0, tiny, NaN
    x = bits.view(dtype)
    tensors, _ = codecs.decode(encode("lossless", x, ids(29)))
    assert torch.equal(tensors["hidden_states"].view(BITS[dtype]), bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_is_smaller_than_raw_on_activation_like_states(dtype: torch.dtype) -> None:
    x = states(tokens=256).to(dtype)
    raw, lossless = (len(encode(c, x, ids(256))) for c in ("raw", "lossless"))
    tensors, _ = codecs.decode(encode("lossless", x, ids(256)))
    assert torch.equal(tensors["hidden_states"].view(BITS[dtype]), x.view(BITS[dtype]))
    # bfloat16's high byte is sign and exponent (3-4 bits of information on such
    # states); float16's also holds 2 mantissa bits, float32's is a quarter of the value.
    assert lossless < {torch.bfloat16: 0.75, torch.float32: 0.9, torch.float16: 0.97}[dtype] * raw


def test_lossless_is_a_plain_safetensors_file_of_uint8_planes() -> None:
    x = states().to(torch.bfloat16)
    tensors = load(encode("lossless", x, ids(37)))
    assert set(tensors) == {codecs.EXPONENT_PLANE, codecs.REST_PLANES, "token_ids"}
    assert tensors[codecs.REST_PLANES].dtype == torch.uint8
    assert tensors[codecs.REST_PLANES].shape == (1, 37, 3, 128)
    # bfloat16's low byte is its rest plane, stored raw.
    bits = x.view(torch.int16)
    low = bits.bitwise_and(0xFF).to(torch.uint8)
    assert torch.equal(tensors[codecs.REST_PLANES][0], low)
    # The high byte, layer-major, is one plain zstd frame (any zstd reader opens it).
    frame = tensors[codecs.EXPONENT_PLANE].numpy().tobytes()
    high = bits.bitwise_right_shift(8).bitwise_and(0xFF).to(torch.uint8).permute(1, 0, 2)
    assert zstandard.ZstdDecompressor().decompress(frame) == high.contiguous().numpy().tobytes()


def version_1_lossless(x: torch.Tensor, token_ids: torch.Tensor) -> bytes:
    """A ``lossless`` object as codec version 1 wrote it: the exponent plane token-major
    [T, L, H], zstd level 1; built here from the bits, not by ``service.codecs``."""
    size = x.element_size()
    words = x.view(BITS[x.dtype]).numpy().view(f"uint{8 * size}")
    planes = [(words >> (8 * (size - 1 - i))).astype("uint8") for i in range(size)]
    frame = zstandard.ZstdCompressor(level=1).compress(planes[0].tobytes())
    tensors = {
        codecs.EXPONENT_PLANE: torch.frombuffer(bytearray(frame), dtype=torch.uint8),
        codecs.REST_PLANES: torch.from_numpy(np.stack(planes[1:])),
        "token_ids": token_ids,
    }
    meta = {"dtype": codecs.dtype_name(x.dtype), "hsx.codec": "lossless"}
    return save(tensors, metadata={**meta, "hsx.codec_version": "1", "model": "m"})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_version_1_objects_still_decode_bit_exact(dtype: torch.dtype) -> None:
    x = states(tokens=41, seed=5).to(dtype)
    old = version_1_lossless(x, ids(41))
    tensors, meta = codecs.decode(old)
    assert meta["hsx.codec_version"] == "1"
    assert torch.equal(tensors["hidden_states"].view(BITS[dtype]), x.view(BITS[dtype]))
    assert tensors["token_ids"].tolist() == ids(41).tolist()
    raw = load(codecs.to_raw(old))["hidden_states"]
    assert torch.equal(raw.view(BITS[dtype]), x.view(BITS[dtype]))
    # Version 2 stores the same states in fewer bytes: a Huffman table per layer.
    assert len(encode("lossless", x, ids(41))) < len(old)


def test_lossless_encodes_alike_from_concurrent_threads() -> None:
    """Each writer thread has its own zstd compressor: parallel objects stay intact."""
    xs = [states(tokens=64 + i, seed=i).to(torch.bfloat16) for i in range(16)]

    def planes(x: torch.Tensor) -> list[bytes]:
        stored = load(encode("lossless", x, ids(len(x))))
        return [stored[name].numpy().tobytes() for name in sorted(stored)]

    alone = [planes(x) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(planes, xs)) == alone
    for x in xs:
        decoded = codecs.decode(encode("lossless", x, ids(len(x))))[0]
        assert torch.equal(decoded["hidden_states"], x)


def test_lossless_refuses_dtypes_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="lossless stores"):
        encode("lossless", torch.zeros(2, 1, 4, dtype=torch.float64), ids(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_error_per_token_and_layer_is_within_bounds(dtype: torch.dtype) -> None:
    reference = states(tokens=512, seed=2)
    x = reference.to(dtype)
    tensors, _ = codecs.decode(encode("fp8", x, ids(512)))
    relative, cosine = row_errors(tensors["hidden_states"], reference)
    # The model dtype's own rounding is part of the error: measured against float32.
    assert relative.max() <= 0.03, relative.max()
    assert cosine.min() >= 0.999, cosine.min()


@pytest.mark.parametrize("outlier", [500.0, 1e5, 1e30, -3e38])
def test_fp8_outliers_beyond_float8_range_give_no_nan_or_inf(outlier: float) -> None:
    x = states(tokens=64, seed=3)
    x[5, 1, 7] = outlier  # a massive activation in one row
    x[9, :, :3] = outlier  # in every layer of another token
    x[11, 2] = 0.0  # an all-zero row
    stored = load(encode("fp8", x, ids(64)))
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.isfinite(stored["hidden_states"].float()).all()
    assert torch.isfinite(stored[codecs.SCALES]).all()
    tensors, _ = codecs.decode(encode("fp8", x, ids(64)))
    got = tensors["hidden_states"]
    assert torch.isfinite(got).all()
    assert torch.equal(got[11, 2], torch.zeros(128))
    assert got[5, 1, 7] == pytest.approx(outlier, rel=0.03)
    nonzero = x.norm(dim=-1) > 0
    relative, cosine = row_errors(got, x)
    assert relative[nonzero].max() <= 0.03
    assert cosine[nonzero].min() >= 0.999


def test_fp8_layout_is_hs_connectors() -> None:
    """float8_e4m3fn values, float32 scales [T, L, 1] that broadcast against them."""
    x = states(tokens=10)
    tensors = load(encode("fp8", x, ids(10)))
    values, scales = tensors["hidden_states"], tensors[codecs.SCALES]
    assert values.dtype == torch.float8_e4m3fn
    assert values.shape == (10, 3, 128)
    assert scales.dtype == torch.float32
    assert scales.shape == (10, 3, 1)
    assert torch.equal(scales.to(torch.bfloat16).float(), scales)  # exact in bfloat16 too
    assert (values.float().abs().amax(dim=-1) <= torch.finfo(torch.float8_e4m3fn).max).all()


@pytest.mark.parametrize("dequantize_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_hs_connectors_fp8_transfer_reads_hsx_fp8_objects(
    tmp_path: Path, dequantize_dtype: torch.dtype
) -> None:
    from hs_connectors import FP8Transfer

    reference = states(tokens=200, seed=4)
    (tmp_path / "hs_0.safetensors").write_bytes(
        encode("fp8", reference.to(torch.bfloat16), ids(200), {"model": "m"})
    )
    sample = FP8Transfer(tmp_path, dequantize_dtype=dequantize_dtype).get_cached(0)
    assert sample is not None
    assert set(sample) == {"hidden_states", "token_ids"}
    assert sample["hidden_states"].dtype == dequantize_dtype
    assert sample["token_ids"].tolist() == ids(200).tolist()
    relative, cosine = row_errors(sample["hidden_states"], reference)
    assert relative.max() <= 0.03
    assert cosine.min() >= 0.999


def test_bf16_equals_the_float32_states_cast_to_bfloat16() -> None:
    x = states()
    stored = load(encode("bf16", x, ids(37)))["hidden_states"]
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored, x.to(torch.bfloat16))
    tensors, meta = codecs.decode(encode("bf16", x, ids(37)))
    assert meta["dtype"] == "float32"
    assert torch.equal(tensors["hidden_states"], x.to(torch.bfloat16).float())


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_to_raw_gives_a_raw_object_of_the_decoded_states(codec: codecs.Codec) -> None:
    x = states()
    data = encode(codec, x, ids(37), {"model": "m", "layer_ids": "[1, 2, 4]"})
    raw = codecs.to_raw(data)
    tensors = load(raw)
    assert set(tensors) == {"hidden_states", "token_ids"}
    assert torch.equal(tensors["hidden_states"], codecs.decode(data)[0]["hidden_states"])
    meta = codecs.read_metadata(raw)
    assert meta["hsx.codec"] == "raw"
    assert (meta["model"], meta["layer_ids"], meta["dtype"]) == ("m", "[1, 2, 4]", "float32")
    if codec == "raw":
        assert raw == data
    else:
        assert meta[codecs.DECODED_FROM_KEY] == codec


def test_objects_from_before_codecs_decode_as_raw() -> None:
    x = states()
    old = save({"hidden_states": x, "token_ids": ids(37)}, metadata={"format_version": "1"})
    tensors, meta = codecs.decode(old)
    assert codecs.codec_of(meta) == "raw"
    assert torch.equal(tensors["hidden_states"], x)
    assert codecs.to_raw(old) == old


def test_unknown_codec_or_version_is_refused_by_name() -> None:
    meta = {"hsx.codec": "zfp", "dtype": "float32"}
    data = save({"hidden_states": states(), "token_ids": ids(37)}, metadata=meta)
    with pytest.raises(ValueError, match="unknown codec 'zfp'"):
        codecs.decode(data)
    meta = {"hsx.codec": "fp8", "hsx.codec_version": "9", "dtype": "float32"}
    data = save({"hidden_states": states(), "token_ids": ids(37)}, metadata=meta)
    with pytest.raises(ValueError, match=r"codec version 9 is not one this reader knows"):
        codecs.decode(data)
    # A newer layout than this reader's: refused, not misread.
    tensors = load(encode("lossless", states().to(torch.bfloat16), ids(37)))
    meta = {"hsx.codec": "lossless", "hsx.codec_version": "3", "dtype": "bfloat16"}
    with pytest.raises(ValueError, match=r"codec version 3 .* \(1 to 2\); upgrade hsx"):
        codecs.decode(save(tensors, metadata=meta))
    with pytest.raises(ValueError, match="choose one of raw, fp8, bf16, lossless"):
        codecs.prepare("zfp", states())  # type: ignore[arg-type]


def test_offered_codecs_depend_on_the_model_dtype() -> None:
    assert codecs.offered("float32") == list(codecs.CODECS)  # every codec, in order
    # bf16 only downcasts: every other codec is offered for any model dtype.
    assert codecs.offered("bfloat16") == [c for c in codecs.CODECS if c != "bf16"]
    assert codecs.check_codec("fp8", "bfloat16") == "fp8"
    with pytest.raises(ValueError, match="choose one of raw, fp8, lossless"):
        codecs.check_codec("bf16", "bfloat16")


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_prepared_nbytes_is_what_prepare_hands_over(codec: codecs.Codec) -> None:
    x = states()
    prepared = codecs.prepare(codec, x)
    actual = sum(t.numel() * t.element_size() for t in prepared.values())
    assert codecs.prepared_nbytes(codec, (37, 3, 128), torch.float32) == actual


class StalledStorage(FaultyStorage):
    """Real local storage whose puts wait for ``GATE``: a store that has stalled."""

    async def put(self, key: str, data: Data) -> Any:
        await asyncio.to_thread(GATE.wait, 60)
        return await self.inner.put(key, data)


GATE = threading.Event()


def open_stalled_storage(settings: Any) -> StalledStorage:
    from service.storage import open_backend

    return StalledStorage(open_backend(settings), 0.0)


async def test_writer_counts_an_object_at_its_encoded_size(tmp_path: Path) -> None:
    """Copied out at the model dtype's size; once encoded, only the encoded bytes count."""
    from service.config import StorageSettings
    from service.engine.completion import CompletionReceiver, CompletionSender
    from service.engine.jobs import CopyOut, PendingSave, WriteJob
    from service.engine.writer import WriterPool
    from service.storage.keys import new_object_key

    GATE.clear()
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'completions.sock'}")
    receiver.start()
    pool = WriterPool(
        StorageSettings(url=str(tmp_path / "objects")),
        CompletionSender(receiver.address, receiver.secret),
        max_bytes_in_flight=1 << 30,
        max_concurrent_writes=2,
        storage_factory="tests.codecs.test_codecs:open_stalled_storage",
    )
    x = states(tokens=300)
    copied = x.numel() * x.element_size()
    key = new_object_key("hsx", "default")
    done = receiver.expect(key)
    assert pool.budget.reserve(copied)
    assert pool.budget.in_flight == copied
    meta = {"model": "m", "dtype": "float32", "layer_ids": "[1, 2, 4]"}
    save = PendingSave("r", key, tuple(ids(300).tolist()), (), meta, (1, 2, 4), codec="fp8")
    pool.submit(WriteJob(save, CopyOut({"hidden_states": x}), copied))
    while pool.budget.in_flight == copied:  # the writer thread encodes
        await asyncio.sleep(0.01)
    encoded = pool.budget.in_flight
    GATE.set()
    completion = await asyncio.wait_for(done, 60)
    assert completion.stored is not None, completion.failure
    assert completion.stored.size == encoded == (tmp_path / "objects" / key).stat().st_size
    assert encoded < 0.3 * copied  # a quarter of float32, plus scales and the header
    assert completion.bytes_in_flight == pool.budget.in_flight == 0
    pool.close()
    await receiver.close()


def test_server_default_codec_is_a_setting_refusing_unknown_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pydantic import ValidationError

    from service.config import Settings

    assert Settings().storage.codec == "raw"
    monkeypatch.setenv("HSX_STORAGE__CODEC", "lossless")
    assert Settings().storage.codec == "lossless"
    monkeypatch.setenv("HSX_STORAGE__CODEC", "zfp")
    with pytest.raises(ValidationError, match=r"storage\.codec"):
        Settings()


# ==============================
# Malformed objects (issue 26, finding 6): every reader is total over any bytes
# ==============================


def rewrite_header(data: bytes, change: Any) -> bytes:
    """``data`` with its safetensors header JSON replaced by ``change(header)``; the
    tensor bytes stay as they were."""
    import json

    length = int.from_bytes(data[:8], "little")
    header = change(json.loads(data[8 : 8 + length]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length :]


def _set(path: tuple[str, ...], value: Any) -> Any:
    def change(header: dict[str, Any]) -> Any:
        node = header
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        return header

    return change


def _object(codec: codecs.Codec, **meta: str) -> bytes:
    return encode(codec, states(tokens=6, layers=2, hidden=16), ids(6), meta or None)


def _fp8_without_scales() -> bytes:
    tensors = load(_object("fp8"))
    del tensors[codecs.SCALES]
    return save(tensors, metadata=codecs.read_metadata(_object("fp8")))


def _lossless_without_exponents() -> bytes:
    tensors = load(_object("lossless"))
    del tensors[codecs.EXPONENT_PLANE]
    return save(tensors, metadata=codecs.read_metadata(_object("lossless")))


def _raw_without_token_ids() -> bytes:
    return save({"hidden_states": states(tokens=6)}, metadata={"dtype": "float32"})


def _lossless_with_garbage_frame() -> bytes:
    tensors = load(_object("lossless"))
    frame = tensors[codecs.EXPONENT_PLANE]
    tensors[codecs.EXPONENT_PLANE] = torch.full_like(frame, 0x5A)
    return save(tensors, metadata=codecs.read_metadata(_object("lossless")))


def _states_of_other_length() -> bytes:
    return save(
        {"hidden_states": states(tokens=6), "token_ids": ids(5)}, metadata={"dtype": "float32"}
    )


#: name -> (bytes, what the error says). The issue's six shapes that answered 500 come
#: first, then the raw object with a 2^62 header length that decoded as 200, then more.
CORRUPT: dict[str, tuple[Any, str]] = {
    "header is a JSON list": (
        lambda: rewrite_header(_object("fp8"), lambda h: [h]),
        "header is a JSON list",
    ),
    "__metadata__ is a list": (
        lambda: rewrite_header(_object("fp8"), _set(("__metadata__",), ["dtype", "float32"])),
        "__metadata__ is not an object of strings",
    ),
    "truncated fp8": (lambda: _object("fp8")[:-40], "the tensors hold"),
    "truncated lossless": (lambda: _object("lossless")[:-7], "the tensors hold"),
    "fp8 with an int dtype": (
        lambda: rewrite_header(_object("fp8"), _set(("__metadata__", "dtype"), "int64")),
        "dtype 'int64'",
    ),
    "fp8 with int states": (
        lambda: rewrite_header(_object("fp8"), _set(("hidden_states", "dtype"), "I8")),
        "hidden_states is I8",
    ),
    "fp8 missing its scales": (_fp8_without_scales, "needs the tensor 'hidden_states_scales'"),
    "lossless missing its exponents": (
        _lossless_without_exponents,
        "needs the tensor 'hidden_states.exponent_zstd'",
    ),
    "raw missing token_ids": (_raw_without_token_ids, "needs the tensor 'token_ids'"),
    "raw with a 2^62 header length": (
        lambda: (1 << 62).to_bytes(8, "little") + _object("raw")[8:],
        f"a header of {1 << 62} bytes",
    ),
    "empty": (lambda: b"", "0 bytes"),
    "header not JSON": (lambda: (8).to_bytes(8, "little") + b"{nope!!}", "not JSON"),
    "header not UTF-8": (lambda: (8).to_bytes(8, "little") + b"{\xff\xfe    }", "not JSON"),
    "offsets past the end": (
        lambda: rewrite_header(_object("raw"), _set(("token_ids", "data_offsets"), [0, 1 << 40])),
        "bytes for shape",
    ),
    "shape of other size": (
        lambda: rewrite_header(_object("raw"), _set(("hidden_states", "shape"), [6, 2, 17])),
        "bytes for shape",
    ),
    "a boolean in a shape": (
        lambda: rewrite_header(_object("raw"), _set(("token_ids", "shape"), [True])),
        "non-negative integers",
    ),
    "states and token ids disagree": (_states_of_other_length, "states of 6 tokens"),
    "lossless planes for another dtype": (
        lambda: rewrite_header(_object("lossless"), _set(("__metadata__", "dtype"), "bfloat16")),
        "holds 3 byte planes; bfloat16 needs 1",
    ),
    "lossless frame that is not zstd": (_lossless_with_garbage_frame, "not a zstd frame"),
    "layer_ids not a list of ids": (
        lambda: _object("raw", layer_ids="[1, 2"),
        "not a JSON list of 2 layer ids",
    ),
}


#: Found only by decompressing: ``read_object`` reads headers, never tensor data.
FOUND_BY_DECODING = {"lossless frame that is not zstd"}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_malformed_objects_are_refused_by_one_error(case: str) -> None:
    make, says = CORRUPT[case]
    data = make()
    readers = [codecs.decode, codecs.to_raw]
    if case not in FOUND_BY_DECODING:
        readers.append(codecs.read_object)
    else:
        codecs.read_object(data)
    for read in readers:
        with pytest.raises(codecs.CorruptObjectError, match=re.escape(says)):
            read(data)


def test_every_mutation_of_an_object_decodes_or_is_refused() -> None:
    """Truncations and flipped bytes of each codec's object, in the header and in the
    tensors: ``decode`` returns states or raises ValueError, never anything else."""
    rng = np.random.default_rng(26)
    refused = 0
    for codec in codecs.CODECS:
        good = _object(codec, run="r")
        header_end = 8 + int.from_bytes(good[:8], "little")
        for cut in range(0, len(good), 7):
            with pytest.raises(codecs.CorruptObjectError):
                codecs.decode(good[:cut])
        for _ in range(150):
            data = bytearray(good)
            where = int(rng.integers(0, header_end if rng.random() < 0.7 else len(data)))
            data[where] = int(rng.integers(0, 256))
            try:
                codecs.decode(bytes(data))
            except ValueError:
                refused += 1
    assert refused > 200  # most header mutations are refused


def zstd_bomb(size: int, *, declared: bool) -> bytes:
    """One zstd frame of ``size`` zero bytes, made in 1 MiB steps (small in memory)."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    stream = compressor.compressobj(size=size if declared else -1)
    chunk, parts = bytes(1 << 20), []
    for _ in range(size >> 20):
        parts.append(stream.compress(chunk))
    parts.append(stream.flush())
    return b"".join(parts)


@pytest.mark.parametrize("declared", [True, False], ids=["size-declared", "size-unknown"])
def test_a_lossless_exponent_bomb_is_refused_without_inflating_it(declared: bool) -> None:
    # A lossless object of 6 x 2 x 16 states whose exponent plane is a 256 MiB zstd
    # frame: the old reader decompressed all of it before any shape check (+238 MB).
    # Now a frame that declares its size is refused from the declaration, one that
    # does not after at most one byte past the plane's 192.
    import tracemalloc

    bomb = zstd_bomb(256 << 20, declared=declared)
    tensors = load(_object("lossless"))
    tensors[codecs.EXPONENT_PLANE] = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
    data = save(tensors, metadata=codecs.read_metadata(_object("lossless")))
    says = "declares 268435456 bytes" if declared else "holds more than 193 bytes"
    tracemalloc.start()
    try:
        with pytest.raises(codecs.CorruptObjectError, match=says):
            codecs.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(data) + (1 << 20), peak  # the object's copies, never the frame's
