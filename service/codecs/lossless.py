"""The ``lossless`` codec: the model dtype's byte planes, bit-exact, the exponent plane
compressed with zstd (on the CPU, so the states cross to the host as they are)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from service.codecs.registry import (
    MODEL_DTYPES,
    CodecImpl,
    Shape,
    TensorCheck,
    register,
    states_nbytes,
)
from service.codecs.safetensors_io import corrupt, dtype_name

if TYPE_CHECKING:
    import numpy as np
    import torch
    import zstandard

EXPONENT_PLANE = "hidden_states.exponent_zstd"
REST_PLANES = "hidden_states.rest"
#: zstd settings of the exponent plane (strategy "fast"). The plane holds skewed byte
#: values with few repeats, so Huffman coding of the literals does nearly all the work and
#: match finding mostly burns CPU: a 64-entry hash table and 7-byte minimum matches find
#: almost none, at a third of level 1's CPU and, with a block per layer, a smaller plane
#: than level 1's (codec_bench measures both). ``target_length`` stays 0: above 0 the
#: fast strategy stops Huffman-coding literals (zstd's negative levels), which doubles
#: the plane. No checksum: storage checks whole objects.
ZSTD_PARAMS = {
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
    "target_length": 0,
    "write_checksum": False,
    "write_content_size": True,
}
#: The dtypes it stores: every model dtype.
LOSSLESS_DTYPES = MODEL_DTYPES
#: Bytes per element of each model dtype.
_MODEL_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Smallest zstd window a reader accepts for an exponent plane; the plane's own size
#: when larger (a frame whose content size is known uses that as its window).
_MIN_WINDOW = 1 << 20


@register
class LosslessCodec(CodecImpl):
    """``lossless``: the model dtype's byte planes, bit-exact.

    The most significant byte (sign and exponent bits) is compressed with zstd as
    ``hidden_states.exponent_zstd`` (uint8 [bytes]: one zstd frame of the plane in
    layer-major order [L, T, H], each layer starting a new zstd block), the other bytes
    stored raw as ``hidden_states.rest`` (uint8 [element_size - 1, T, L, H], most
    significant first). Exponents of activations are few and skewed, mantissas are
    noise: compressing only the exponent plane gets nearly all the gain of compressing
    everything, at a fraction of the CPU. Each layer has its own scale, so its own
    exponent histogram: a block per layer gets its own Huffman table. Version 1 (still
    read) stored the exponent plane token-major [T, L, H]. zstd runs on the CPU, so the
    states cross to the host as they are.
    """

    name = "lossless"
    summary = "zstd exponent plane, bit-exact"
    tensor_names = frozenset({EXPONENT_PLANE, REST_PLANES})

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden_states": states}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return states_nbytes(shape, dtype)

    def to_tensors(self, prepared: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return split_planes(prepared["hidden_states"])

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        element = _MODEL_SIZES[dtype or ""]
        planes, *shape = tensor(REST_PLANES, ["U8"], 4)
        tensor(EXPONENT_PLANE, ["U8"], 1)
        if planes != element - 1:
            raise corrupt(f"{REST_PLANES} holds {planes} byte planes; {dtype} needs {element - 1}")
        return shape

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        assert dtype is not None  # needs_dtype: read_object refused an object without
        return join_planes(tensors[EXPONENT_PLANE], tensors[REST_PLANES], dtype, version != 1)


# ==============================
# Encoding
# ==============================


def split_planes(states: torch.Tensor) -> dict[str, torch.Tensor]:
    """``lossless`` tensors of ``states`` [T, L, H]: the zstd exponent plane plus the
    raw other planes.

    Each plane is one vectorised shift of the states' bits (as unsigned integers) into a
    uint8 array: one pass per plane and no byte-order bookkeeping.
    """
    import numpy as np
    import torch

    words = _words(states)
    size = words.itemsize
    # unsafe casting keeps the low byte of each shifted word: that byte plane.
    high = np.empty((words.shape[1], words.shape[0], words.shape[2]), dtype=np.uint8)
    np.right_shift(words.transpose(1, 0, 2), 8 * (size - 1), out=high, casting="unsafe")
    rest = np.empty((size - 1, *words.shape), dtype=np.uint8)  # most significant first
    for i, plane in enumerate(rest):
        np.right_shift(words, 8 * (size - 2 - i), out=plane, casting="unsafe")
    return {
        EXPONENT_PLANE: torch.frombuffer(_compress_layers(high), dtype=torch.uint8),
        REST_PLANES: torch.from_numpy(rest),
    }


def _compress_layers(high: np.ndarray[Any, Any]) -> bytearray:
    """One zstd frame of ``high`` [L, T, H], each layer flushed as its own block(s)."""
    import zstandard

    stream = _compressor().compressobj(size=high.size)
    parts = []
    for layer in high:
        parts += [stream.compress(layer), stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
    parts.append(stream.flush())
    return bytearray().join(parts)


def _words(states: torch.Tensor) -> np.ndarray[Any, Any]:
    """``states``' bits as a numpy array of unsigned integers of the same size (no copy)."""
    import torch

    name = dtype_name(states.dtype)
    if name not in LOSSLESS_DTYPES:
        raise ValueError(f"lossless stores {', '.join(LOSSLESS_DTYPES)} states, not {name}")
    unsigned = getattr(torch, f"uint{8 * states.element_size()}")
    words: np.ndarray[Any, Any] = states.contiguous().view(unsigned).numpy()
    return words


_ZSTD = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for exponent planes (compressors are not thread-safe;
    reusing one saves its set-up on every object)."""
    compressor: zstandard.ZstdCompressor | None = getattr(_ZSTD, "compressor", None)
    if compressor is None:
        import zstandard

        params = zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST, **ZSTD_PARAMS
        )
        compressor = _ZSTD.compressor = zstandard.ZstdCompressor(compression_params=params)
    return compressor


# ==============================
# Decoding
# ==============================


def join_planes(
    exponent: torch.Tensor, rest: torch.Tensor, dtype: torch.dtype, layer_major: bool = True
) -> torch.Tensor:
    """The states ``split_planes`` stored, bit for bit. ``layer_major``: the exponent
    plane is [L, T, H] (version 2); version 1 stored it [T, L, H].

    CorruptObjectError when the exponent frame is not one zstd frame of exactly one
    byte per value: refused from its declared size where it has one, else after
    decompressing at most one byte more than the plane holds.
    """
    import numpy as np
    import torch

    size = rest.shape[0] + 1
    tokens, layers, hidden = rest.shape[1:]
    high = _decompress_plane(exponent.numpy().data, tokens * layers * hidden)
    words = np.empty((tokens, layers, hidden), dtype=f"uint{8 * size}")
    if layer_major:
        words[...] = high.reshape(layers, tokens, hidden).transpose(1, 0, 2)
    else:
        words[...] = high.reshape(tokens, layers, hidden)
    for plane in rest.numpy():  # most significant first
        words <<= 8
        words |= plane
    return torch.from_numpy(words).view(dtype)


def _decompress_plane(frame: memoryview, expected: int) -> np.ndarray[Any, Any]:
    """The ``expected`` bytes of an exponent plane's zstd frame, decompressing no more
    than ``expected + 1`` bytes (and holding a window of at most about that) whatever
    the frame claims."""
    import numpy as np
    import zstandard

    name = EXPONENT_PLANE
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        raise corrupt(f"{name} is not a zstd frame") from None
    if declared not in (-1, expected):  # -1: the frame does not say
        raise corrupt(f"{name} declares {declared} bytes; the states have {expected} values")
    window = max(_MIN_WINDOW, 1 << max(expected - 1, 1).bit_length())
    out = np.empty(expected + 1, dtype=np.uint8)
    view, filled = out.data, 0
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=window).stream_reader(frame)
        with reader:
            while filled <= expected and (got := reader.readinto(view[filled:])):
                filled += got
    except zstandard.ZstdError as exc:
        raise corrupt(f"{name} does not decompress ({exc})") from None
    if filled != expected:
        more = "more than" if filled > expected else "only"
        raise corrupt(f"{name} holds {more} {filled} bytes; the states have {expected} values")
    return out[:expected]
