"""Object codecs: how one object's hidden states are stored, and how to read them back.

One module for the server (the worker's writer encodes, ``GET /objects?decode=true``
decodes) and for clients, so it imports nothing of hsx and only torch (and its numpy),
safetensors and zstandard (lazily, so the codec names cost nothing to import). Every
codec writes a valid safetensors file with ``token_ids`` int64 [T] and string
``__metadata__`` naming the codec (``hsx.codec``), the format version
(``hsx.codec_version``) and the dtype the states decode to (``dtype``, the model's).

Each codec is one :class:`CodecImpl` subclass registered in :data:`CODECS` (its class
docstring gives its layout); everything that names the codecs (the ``Codec`` type, the
settings, the API's schema, ``offered``) derives from that registry, so a new codec is
one class here and its test.

Encoding has two stages so a GPU can do the first before the device-to-host copy:
``prepare`` (a tensor transform; runs on any device) and ``pack_parts`` (CPU: byte
planes, zstd, safetensors). ``decode`` reads any codec back.
"""

from __future__ import annotations

import json
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch
    import zstandard

#: Version of the codec layouts; bumped when one of them changes. Readers read every
#: version up to theirs. 2: ``lossless``'s exponent plane is layer-major (1: token-major).
CODEC_VERSION = "2"
CODEC_KEY = "hsx.codec"
CODEC_VERSION_KEY = "hsx.codec_version"
#: The codec a decoded object was stored with (set by ``to_raw``).
DECODED_FROM_KEY = "hsx.decoded_from"
#: Metadata of an object that keeps some token positions only: the selection as JSON
#: (``"last"``, ``"mean"``, ``"mean_loss"`` or ``{"start": s, "end": e}``). Such an
#: object has a ``positions`` int64 tensor (the positions of ``token_ids`` kept, or for
#: a mean those averaged over) and ``hidden_states`` rows for them (one for a mean).
TOKENS_KEY = "hsx.tokens"
POOLED_SELECTIONS = frozenset({'"mean"', '"mean_loss"'})
SCALES = "hidden_states_scales"
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
#: Candidate scales per (token, layer) for fp8: amax / 448 times 2^(k/4). Values near the
#: top of a binade lose least to float8's 3 mantissa bits; trying a few shifts and
#: keeping the best keeps the relative error of every row under 3% (one scale: ~3.3%
#: on the worst rows of 128-wide Gaussian states).
FP8_SCALE_STEPS = 4
LOSSLESS_DTYPES = ("float32", "bfloat16", "float16")
#: Dtypes states decode to: the model dtypes hsx serves.
MODEL_DTYPES = LOSSLESS_DTYPES
#: Bytes per element of each model dtype.
_MODEL_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}

Shape = tuple[int, int, int]
"""[T, L, H]: tokens, layers, hidden size."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of ``__metadata__``)."""
    return str(dtype).removeprefix("torch.")


def states_nbytes(shape: Shape, dtype: torch.dtype) -> int:
    """Bytes of states of ``shape`` in ``dtype`` (a model-dtype host copy)."""
    import torch

    tokens, layers, hidden = shape
    return tokens * layers * hidden * int(torch.empty((), dtype=dtype).element_size())


# ==============================
# The codecs
# ==============================


class CodecImpl(ABC):
    """One codec: the tensors it stores for the states, and the way back.

    A subclass names itself (``name``, the ``hsx.codec`` of its objects) and is
    registered with ``@register``; the module's public functions dispatch to it. Only
    the states' tensors are the codec's: ``token_ids``, ``loss_mask`` and the metadata
    are written and checked alike for every codec.
    """

    name: ClassVar[str]
    #: A few words on what it stores, for settings and schema descriptions (``describe``).
    summary: ClassVar[str]
    #: The tensors it writes for the states (``decode`` returns every other as stored).
    tensor_names: ClassVar[frozenset[str]] = frozenset({"hidden_states"})
    #: Whether its objects must name the dtype they decode to (``raw`` objects from
    #: before the metadata named it need not).
    needs_dtype: ClassVar[bool] = True

    def offered_for(self, model_dtype: str) -> bool:
        """Whether a server of ``model_dtype`` offers it."""
        return True

    @abstractmethod
    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stage one, on the states' device: the tensors to copy to the host."""

    @abstractmethod
    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        """Host bytes of ``prepare``'s tensors for states of ``shape`` and ``dtype``."""

    def to_tensors(self, prepared: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage two, on the CPU: the contiguous tensors stored for ``prepare``'s."""
        return {name: t.contiguous() for name, t in prepared.items()}

    def restore(self, prepared: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The states ``prepare``'s tensors stand for, to validate them before storing."""
        return prepared["hidden_states"]

    @abstractmethod
    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        """[T, L, H] of the states an object's header describes, each of the codec's
        tensors checked with ``tensor`` (CorruptObjectError otherwise). ``dtype`` is
        the object's model dtype (None only where ``needs_dtype`` is False)."""

    @abstractmethod
    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        """The states, in ``dtype``, of an object's (checked) tensors of codec ``version``."""


#: Every codec by name, in the order they are offered and listed.
CODECS: dict[str, CodecImpl] = {}

_C = TypeVar("_C", bound=type[CodecImpl])


def register(cls: _C) -> _C:
    """Class decorator: add an instance of ``cls`` to ``CODECS`` under ``cls.name``."""
    CODECS[cls.name] = cls()
    return cls


@register
class RawCodec(CodecImpl):
    """``raw``: ``hidden_states`` [T, L, H] in the model dtype, vLLM's example-connector
    layout."""

    name = "raw"
    summary = "model dtype"
    needs_dtype = False

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden_states": states}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return states_nbytes(shape, dtype)

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        wanted = [_ST_NAME[dtype]] if dtype else ["F32", "BF16", "F16"]
        return list(tensor("hidden_states", wanted, 3))

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return tensors["hidden_states"]


@register
class Fp8Codec(CodecImpl):
    """``fp8``: ``hidden_states`` float8_e4m3fn and ``hidden_states_scales`` float32
    [T, L, 1], one scale per (token, layer), so ``states = hidden_states.float() *
    scales``.

    This is hs-connectors' layout (``fp8_utils.py``), so its ``FP8Transfer`` and the
    trainers behind it read these objects unchanged. Values are clamped to float8's
    range before the cast (float8_e4m3fn has no infinity: an overflow is NaN on CUDA).
    It shrinks on the device, so on a GPU the device-to-host copy shrinks too.
    """

    name = "fp8"
    summary = "float8 plus per-row scales, hs-connectors' layout"
    tensor_names = frozenset({"hidden_states", SCALES})

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        quantized, scales = quantize_fp8(states)
        return {"hidden_states": quantized, SCALES: scales}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        tokens, layers, hidden = shape
        return tokens * layers * (hidden + 4)  # one byte per value, a float32 per row

    def restore(self, prepared: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return prepared["hidden_states"].float() * prepared[SCALES]  # float32

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        shape = list(tensor("hidden_states", ["F8_E4M3"], 3))
        if tensor(SCALES, ["F32"], 3) != (*shape[:2], 1):
            raise _corrupt(f"{SCALES} must be [T, L, 1] for states {shape}")
        return shape

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return (tensors["hidden_states"].float() * tensors[SCALES]).to(dtype)


@register
class Bf16Codec(CodecImpl):
    """``bf16``: ``hidden_states`` cast to bfloat16, a downcast offered for models
    served in float32 only. It shrinks on the device, as ``fp8`` does."""

    name = "bf16"
    summary = "float32 models only"

    def offered_for(self, model_dtype: str) -> bool:
        return model_dtype == "float32"

    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        return {"hidden_states": states.to(torch.bfloat16)}

    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        tokens, layers, hidden = shape
        return tokens * layers * hidden * 2

    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        return list(tensor("hidden_states", ["BF16"], 3))

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        return tensors["hidden_states"].to(dtype)


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
            raise _corrupt(f"{REST_PLANES} holds {planes} byte planes; {dtype} needs {element - 1}")
        return shape

    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        assert dtype is not None  # needs_dtype: read_object refused an object without
        return join_planes(tensors[EXPONENT_PLANE], tensors[REST_PLANES], dtype, version != 1)


if TYPE_CHECKING:
    Codec = str
else:
    #: A codec's name: at run time the Literal of the registered names, so pydantic
    #: fields of this type validate, document (the OpenAPI enum) and refuse by them.
    Codec = Literal[tuple(CODECS)]


def codec_impl(codec: str) -> CodecImpl:
    """The registered codec ``codec``; ValueError naming the choices otherwise."""
    impl = CODECS.get(codec)
    if impl is None:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return impl


def describe() -> str:
    """Every codec with its summary, for descriptions: "`raw` (model dtype), ... or
    `lossless` (...)"."""
    named = [f"`{name}` ({impl.summary})" for name, impl in CODECS.items()]
    return ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else "".join(named)


def offered(model_dtype: str) -> list[Codec]:
    """The codecs a server of ``model_dtype`` offers (``bf16`` only downcasts float32)."""
    return [name for name, impl in CODECS.items() if impl.offered_for(model_dtype)]


def check_codec(codec: str, model_dtype: str) -> Codec:
    """``codec`` if a server of ``model_dtype`` offers it; ValueError naming the choices."""
    choices = offered(model_dtype)
    if codec not in choices:
        raise ValueError(
            f"codec {codec!r} is not offered for {model_dtype} states; "
            f"choose one of {', '.join(choices)}"
        )
    return codec


# ==============================
# Encoding
# ==============================


def check_layers(layers: Sequence[int] | None, served: Sequence[int]) -> None:
    """ValueError unless ``layers`` is None or a non-empty subset of ``served`` in that
    order (objects keep the server's layer order)."""
    if layers is None:
        return
    wanted, order = list(layers), list(served)
    if not wanted or wanted != [i for i in order if i in wanted]:
        raise ValueError(
            f"{wanted} is not a non-empty subset of the served layer ids {order} in that order"
        )


def prepare(codec: Codec, states: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stage one: the tensors to copy to the host. Runs on the states' device.

    ``fp8`` and ``bf16`` shrink here, so on a GPU the device-to-host copy shrinks too;
    ``raw`` and ``lossless`` pass the states through (zstd runs on the CPU).
    """
    return codec_impl(codec).prepare(states)


def prepared_nbytes(codec: Codec, shape: Shape, dtype: torch.dtype) -> int:
    """Host bytes of ``prepare``'s tensors for states of ``shape`` and ``dtype``."""
    return codec_impl(codec).prepared_nbytes(shape, dtype)


def restore(codec: Codec, prepared: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The states ``prepare``'s tensors stand for (float32 for fp8; lossless: as is)."""
    return codec_impl(codec).restore(prepared)


def pack_parts(
    codec: Codec,
    prepared: Mapping[str, torch.Tensor],
    token_ids: torch.Tensor,
    metadata: Mapping[str, str],
    extra: Mapping[str, torch.Tensor] | None = None,
) -> list[bytes | memoryview]:
    """Stage two, on the CPU: the object's safetensors bytes in pieces, without copying
    the tensors: the safetensors header, then each tensor's own memory (the pieces keep
    the tensors alive).

    ``metadata`` must name the model ``dtype`` the states decode to; ``hsx.codec`` and
    ``hsx.codec_version`` are set here. ``extra`` tensors (e.g. ``loss_mask``) are
    stored as they are. The writer hands the pieces to storage as they are, so an
    object's states are read once, by the write, instead of being copied into one
    buffer first.
    """
    import torch

    if "dtype" not in metadata:
        raise ValueError("metadata must name the states' dtype")
    tensors = codec_impl(codec).to_tensors(prepared)
    tensors["token_ids"] = token_ids.to(torch.int64).contiguous()
    tensors.update({name: t.contiguous() for name, t in (extra or {}).items()})
    meta = {**metadata, CODEC_KEY: codec, CODEC_VERSION_KEY: CODEC_VERSION}
    return safetensors_parts(tensors, meta)


#: safetensors' dtypes: the torch name, safetensors' name, bytes per element and the
#: numpy dtype (None: numpy has none), in the order its writer ranks them: tensors are
#: laid out highest rank first (then by name), so our bytes equal
#: ``safetensors.torch.save``'s.
_SAFETENSORS_DTYPES: tuple[tuple[str, str, int, str | None], ...] = (
    ("bool", "BOOL", 1, "?"),
    ("uint8", "U8", 1, "u1"),
    ("int8", "I8", 1, "i1"),
    ("float8_e5m2", "F8_E5M2", 1, None),
    ("float8_e4m3fn", "F8_E4M3", 1, None),
    ("int16", "I16", 2, "<i2"),
    ("uint16", "U16", 2, "<u2"),
    ("float16", "F16", 2, "<f2"),
    ("bfloat16", "BF16", 2, None),
    ("int32", "I32", 4, "<i4"),
    ("uint32", "U32", 4, "<u4"),
    ("float32", "F32", 4, "<f4"),
    ("float64", "F64", 8, "<f8"),
    ("int64", "I64", 8, "<i8"),
    ("uint64", "U64", 8, "<u8"),
)
_ST_NAME = {torch_name: st for torch_name, st, _, _ in _SAFETENSORS_DTYPES}
_ST_RANK = {row[0]: rank for rank, row in enumerate(_SAFETENSORS_DTYPES)}
#: Bytes per element of each safetensors dtype.
_ST_SIZES = {st: size for _, st, size, _ in _SAFETENSORS_DTYPES}
_ST_NUMPY = {st: numpy for _, st, _, numpy in _SAFETENSORS_DTYPES}


def safetensors_parts(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> list[bytes | memoryview]:
    """A safetensors file of contiguous CPU ``tensors`` as [header, tensor bytes...].

    Laid out as ``safetensors.torch.save`` lays it out (its tensor order, compact JSON,
    the header padded with spaces to 8 bytes), without copying a tensor. Metadata keys
    are sorted, where safetensors writes them in an order that changes from process to
    process: the same object gives the same bytes, and the same SHA-256.
    """
    import torch

    if sys.byteorder != "little":  # safetensors is little-endian: let it swap bytes
        from safetensors.torch import save

        return [save(dict(tensors), metadata=dict(metadata))]
    order = sorted(tensors, key=lambda n: (-_ST_RANK[dtype_name(tensors[n].dtype)], n))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    views: list[bytes | memoryview] = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        header[name] = {
            "dtype": _ST_NAME[dtype_name(tensor.dtype)],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        offset += view.nbytes
        views.append(view)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views]


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and float32 scales [T, L, 1]: ``values * scales ~ states``.

    Scales are exact in bfloat16 too, so readers that multiply in bfloat16
    (``FP8Transfer``'s default) lose nothing on them.
    """
    import torch

    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    x = states.float()
    ladder = torch.tensor([2.0 ** (k / FP8_SCALE_STEPS) for k in range(FP8_SCALE_STEPS)])
    base = x.abs().amax(dim=-1, keepdim=True) / top
    # [T, L, steps]; the floor keeps all-zero rows finite.
    scales = (base * ladder.to(x.device)).to(torch.bfloat16).float()
    scales = scales.clamp(min=torch.finfo(torch.bfloat16).tiny)
    errors = []
    for step in range(FP8_SCALE_STEPS):
        scale = scales[..., step : step + 1]
        scaled = x / scale
        lost = scaled.clamp(-top, top).to(fp8).float() - scaled
        # In units of the first scale: scale**2 itself overflows float32 for huge rows.
        errors.append(
            torch.linalg.vector_norm(lost, dim=-1, keepdim=True) * (scale / scales[..., :1])
        )
    best = scales.gather(-1, torch.cat(errors, dim=-1).argmin(dim=-1, keepdim=True))
    return (x / best).clamp(-top, top).to(fp8), best


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


class CorruptObjectError(ValueError):
    """Bytes that are not a well-formed object: not safetensors, or not what the codec
    named in its metadata writes. The readers here (``read_metadata``,
    ``read_object``, ``decode``, ``to_raw``) raise it for any malformed input, after
    work bounded by the input's size, and nothing else (a ValueError, as for an
    unknown codec or version)."""


#: safetensors' own ceiling on the JSON header; its reader refuses a longer one.
MAX_HEADER_BYTES = 100_000_000
#: Smallest zstd window a reader accepts for an exponent plane; the plane's own size
#: when larger (a frame whose content size is known uses that as its window).
_MIN_WINDOW = 1 << 20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header, checked against the bytes it describes."""

    dtype: str
    """safetensors' dtype name (``F32``, ``U8``, ...)."""
    shape: tuple[int, ...]
    begin: int
    """Where its bytes start and end in the whole object (header included)."""
    end: int


@dataclass(frozen=True)
class ObjectHeader:
    """What an object's header says, every part checked (``read_object``); no tensor
    data has been read yet, nothing decompressed."""

    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    codec: Codec
    version: int
    shape: tuple[int, int, int]
    """[T, L, H] of the states the object decodes to."""
    dtype: str | None
    """The model dtype the states decode to; None only for ``raw`` objects from
    before the metadata named it."""
    layer_ids: tuple[int, ...] | None
    """The ``layer_ids`` metadata (one per stored layer), if the object has one."""

    def bytes_of(self, data: bytes | memoryview, name: str) -> memoryview:
        """The bytes of tensor ``name`` in ``data`` (the object this header was read from)."""
        entry = self.tensors[name]
        return memoryview(data)[entry.begin : entry.end]


@dataclass(frozen=True)
class TensorCheck:
    """Checks the tensors of one object's header against what its codec writes."""

    codec: str
    tensors: Mapping[str, TensorEntry]

    def __call__(self, name: str, dtypes: Sequence[str], rank: int) -> tuple[int, ...]:
        """The shape of tensor ``name``: CorruptObjectError unless it is there, of one of
        ``dtypes`` (safetensors' names, the one the codec writes first) and ``rank``."""
        entry = self.tensors.get(name)
        if entry is None:
            raise _corrupt(f"a {self.codec} object needs the tensor {name!r}")
        if entry.dtype not in dtypes or len(entry.shape) != rank:
            raise _corrupt(
                f"{name} is {entry.dtype} {list(entry.shape)}; {self.codec} writes {dtypes[0]}"
            )
        return entry.shape


def _corrupt(reason: str) -> CorruptObjectError:
    return CorruptObjectError(f"not a well-formed hidden-state object: {reason}")


def read_safetensors_header(
    data: bytes | memoryview,
) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    """``(metadata, tensors)`` of a safetensors file, or CorruptObjectError.

    As strict as safetensors' own reader: a header length within the data (and at most
    ``MAX_HEADER_BYTES``), a JSON object, string-to-string ``__metadata__``, and for
    every tensor a known dtype, a shape of non-negative integers and offsets that hold
    exactly its bytes, the tensors filling the data after the header with no gap or
    overlap. Work is bounded by the header's length.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise _corrupt(f"{view.nbytes} bytes, shorter than a safetensors header length")
    length = int.from_bytes(view[:8], "little")
    if length > min(MAX_HEADER_BYTES, view.nbytes - 8):
        raise _corrupt(f"a header of {length} bytes in an object of {view.nbytes}")
    return parse_safetensors_header(view[: 8 + length], view.nbytes)


def parse_safetensors_header(
    header: bytes | memoryview, size: int
) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    """``read_safetensors_header`` from the header alone (its 8-byte length and JSON)
    of a file of ``size`` bytes: the same checks, no tensor byte needed."""
    view = memoryview(header).cast("B")
    length = view.nbytes - 8
    try:
        parsed = json.loads(bytes(view[8 : 8 + length]))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deeply
        raise _corrupt(f"the header is not JSON ({type(exc).__name__})") from None
    if not isinstance(parsed, dict):
        raise _corrupt(f"the header is a JSON {type(parsed).__name__}, not an object")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _corrupt("__metadata__ is not an object of strings")
    start, tensors = 8 + length, {}
    for name, spec in parsed.items():
        tensors[name] = _tensor_entry(name, spec, start)
    position = start
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise _corrupt(f"tensor {name[:64]!r} does not start where the one before ends")
        position = entry.end
    if position != size:
        raise _corrupt(f"the tensors hold {position - start} bytes, the object {size - start}")
    return metadata, tensors


def _tensor_entry(name: str, spec: Any, start: int) -> TensorEntry:
    label = f"tensor {name[:64]!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(f"{label} is not described by dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in _ST_SIZES:
        raise _corrupt(f"{label} has an unknown dtype {str(dtype)[:32]!r}")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise _corrupt(f"{label}: shape and data_offsets must be non-negative integers")
    begin, end = offsets
    count = 1
    for size in shape:
        count *= size
    if end - begin != count * _ST_SIZES[dtype]:
        raise _corrupt(f"{label}: {end - begin} bytes for shape {shape} of {dtype}")
    return TensorEntry(dtype, tuple(shape), start + begin, start + end)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        type(v) is int and v >= 0
        for v in value  # bool is not a size
    )


def read_metadata(data: bytes | memoryview) -> dict[str, str]:
    """An object's ``__metadata__`` (the safetensors header only; no tensor is read).

    CorruptObjectError unless the header is well-formed (``read_safetensors_header``).
    """
    return read_safetensors_header(data)[0]


def read_object(data: bytes | memoryview) -> ObjectHeader:
    """An object's header with every part checked against its codec, before any tensor
    is read or anything decompressed: CorruptObjectError (or ValueError naming an
    unknown codec or version) otherwise.

    Every codec: ``token_ids`` int64 [T], ``loss_mask`` (if any) uint8 [T], the
    ``dtype`` a model dtype, ``layer_ids`` (if any) a JSON list of one integer per
    layer. Then the states' tensors as the codec writes them (``CodecImpl.check``).
    """
    metadata, tensors = read_safetensors_header(data)
    codec = codec_of(metadata)
    impl = CODECS.get(codec)
    if impl is None:
        raise ValueError(f"unknown codec {codec!r}; this reader knows {', '.join(CODECS)}")
    version = metadata.get(CODEC_VERSION_KEY, "1")  # objects from before versions: 1
    if not version.isdigit() or not 1 <= int(version) <= int(CODEC_VERSION):
        raise ValueError(
            f"codec version {version[:16]} is not one this reader knows (1 to {CODEC_VERSION});"
            " upgrade hsx"
        )
    dtype = metadata.get("dtype")
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise _corrupt(f"dtype {dtype[:32]!r} is not one of {', '.join(MODEL_DTYPES)}")
    if dtype is None and impl.needs_dtype:
        raise _corrupt(f"a {codec} object must name the dtype its states decode to")
    tensor = TensorCheck(codec, tensors)
    tokens = tensor("token_ids", ["I64"], 1)[0]
    shape = impl.check(tensor, dtype)
    rows = _selected_rows(metadata, tensor, tokens)
    if shape[0] != rows:
        raise _corrupt(f"states of {shape[0]} tokens, token_ids of {tokens}, {rows} selected")
    if "loss_mask" in tensors and tensor("loss_mask", ["U8"], 1)[0] != tokens:
        raise _corrupt(f"loss_mask does not hold one value per token ({tokens})")
    layer_ids = _layer_ids(metadata, shape[1])
    states = (shape[0], shape[1], shape[2])
    return ObjectHeader(metadata, tensors, codec, int(version), states, dtype, layer_ids)


def read_tensor(data: bytes | memoryview, header: ObjectHeader, name: str) -> np.ndarray[Any, Any]:
    """Tensor ``name`` of the object ``header`` was read from (``read_object``), as a
    read-only numpy view of ``data`` in its shape: no copy, nothing else decoded.

    ValueError for a dtype numpy has no type for (bfloat16, float8).
    """
    import numpy as np

    entry = header.tensors[name]
    numpy = _ST_NUMPY[entry.dtype]
    if numpy is None:
        raise ValueError(f"{name} is {entry.dtype}, which numpy has no dtype for")
    return np.frombuffer(header.bytes_of(data, name), dtype=np.dtype(numpy)).reshape(entry.shape)


def _selected_rows(metadata: Mapping[str, str], tensor: TensorCheck, tokens: int) -> int:
    """The ``hidden_states`` rows an object must hold: one per token, or under a token
    selection (``TOKENS_KEY``) one per kept position, or one for a mean."""
    selection = metadata.get(TOKENS_KEY)
    if selection is None:
        return tokens
    positions = tensor("positions", ["I64"], 1)[0]
    if not 0 < positions <= tokens:
        raise _corrupt(f"positions: {positions} of {tokens} tokens")
    return 1 if selection in POOLED_SELECTIONS else positions


def _layer_ids(metadata: Mapping[str, str], layers: int) -> tuple[int, ...] | None:
    text = metadata.get("layer_ids")
    if text is None:
        return None
    try:
        ids = json.loads(text)
    except (ValueError, RecursionError):
        ids = None
    if not _ints(ids) or len(ids) != layers:
        raise _corrupt(f"layer_ids {text[:64]!r} is not a JSON list of {layers} layer ids")
    return tuple(ids)


def codec_of(metadata: Mapping[str, str]) -> str:
    """The codec an object was stored with; objects from before codecs are ``raw``."""
    return metadata.get(CODEC_KEY, "raw")


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``({"hidden_states", "token_ids", ...}, metadata)`` of any object, the states in
    its dtype; other tensors (``loss_mask``) come back as stored.

    Raises ValueError for a codec (or codec version) this module does not know, and
    CorruptObjectError for bytes that are not a well-formed object of their codec:
    the header is checked first (``read_object``), and a ``lossless`` exponent plane
    is decompressed to at most the size the states' shape gives it.
    """
    import torch
    from safetensors.torch import load

    header = read_object(data)
    try:
        tensors = load(bytes(data))
    except Exception as exc:  # checked above as strictly as safetensors checks
        raise _corrupt(f"safetensors could not read it ({exc})") from None
    dtype = getattr(torch, header.dtype) if header.dtype else None
    states = CODECS[header.codec].from_tensors(tensors, dtype, header.version)
    codec_tensors = frozenset().union(*(impl.tensor_names for impl in CODECS.values()))
    others = {k: v for k, v in tensors.items() if k not in codec_tensors}
    return {"hidden_states": states, **others}, header.metadata


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
        raise _corrupt(f"{name} is not a zstd frame") from None
    if declared not in (-1, expected):  # -1: the frame does not say
        raise _corrupt(f"{name} declares {declared} bytes; the states have {expected} values")
    window = max(_MIN_WINDOW, 1 << max(expected - 1, 1).bit_length())
    out = np.empty(expected + 1, dtype=np.uint8)
    view, filled = out.data, 0
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=window).stream_reader(frame)
        with reader:
            while filled <= expected and (got := reader.readinto(view[filled:])):
                filled += got
    except zstandard.ZstdError as exc:
        raise _corrupt(f"{name} does not decompress ({exc})") from None
    if filled != expected:
        more = "more than" if filled > expected else "only"
        raise _corrupt(f"{name} holds {more} {filled} bytes; the states have {expected} values")
    return out[:expected]


def to_raw(data: bytes) -> bytes:
    """Any object as a ``raw`` one: model-dtype states, the same metadata.

    A ``raw`` object comes back unchanged once its header is checked (``read_object``);
    others name their codec in ``hsx.decoded_from``. Raises what ``decode`` raises.
    """
    from safetensors.torch import save

    header = read_object(data)
    if header.codec == "raw":
        return bytes(data)
    tensors, _ = decode(data)
    meta = {**header.metadata, CODEC_KEY: "raw", CODEC_VERSION_KEY: CODEC_VERSION}
    meta[DECODED_FROM_KEY] = header.codec
    return bytes(save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta))
