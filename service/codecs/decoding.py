"""Reading an object back: its header checked against its codec before any tensor is
read (``read_object``), then the states in the model dtype (``decode``, ``to_raw``).

Every reader here raises CorruptObjectError for bytes that are not a well-formed object
of the codec they name, after work bounded by the input's size, and ValueError for a
codec (or codec version) this package does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.codecs.registry import (
    CODEC_KEY,
    CODEC_VERSION,
    CODEC_VERSION_KEY,
    CODECS,
    DECODED_FROM_KEY,
    MODEL_DTYPES,
    POOLED_SELECTIONS,
    TOKENS_KEY,
    TensorCheck,
)
from service.codecs.safetensors_io import (
    ST_NUMPY,
    TensorEntry,
    are_sizes,
    corrupt,
    read_safetensors_header,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from service.codecs.registry import Codec


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
        raise corrupt(f"dtype {dtype[:32]!r} is not one of {', '.join(MODEL_DTYPES)}")
    if dtype is None and impl.needs_dtype:
        raise corrupt(f"a {codec} object must name the dtype its states decode to")
    tensor = TensorCheck(codec, tensors)
    tokens = tensor("token_ids", ["I64"], 1)[0]
    shape = impl.check(tensor, dtype)
    rows = _selected_rows(metadata, tensor, tokens)
    if shape[0] != rows:
        raise corrupt(f"states of {shape[0]} tokens, token_ids of {tokens}, {rows} selected")
    if "loss_mask" in tensors and tensor("loss_mask", ["U8"], 1)[0] != tokens:
        raise corrupt(f"loss_mask does not hold one value per token ({tokens})")
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
    numpy = ST_NUMPY[entry.dtype]
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
        raise corrupt(f"positions: {positions} of {tokens} tokens")
    return 1 if selection in POOLED_SELECTIONS else positions


def _layer_ids(metadata: Mapping[str, str], layers: int) -> tuple[int, ...] | None:
    text = metadata.get("layer_ids")
    if text is None:
        return None
    try:
        ids = json.loads(text)
    except (ValueError, RecursionError):
        ids = None
    if not are_sizes(ids) or len(ids) != layers:
        raise corrupt(f"layer_ids {text[:64]!r} is not a JSON list of {layers} layer ids")
    return tuple(ids)


def codec_of(metadata: Mapping[str, str]) -> str:
    """The codec an object was stored with; objects from before codecs are ``raw``."""
    return metadata.get(CODEC_KEY, "raw")


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``({"hidden_states", "token_ids", ...}, metadata)`` of any object, the states in
    its dtype; other tensors (``loss_mask``) come back as stored.

    Raises ValueError for a codec (or codec version) this package does not know, and
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
        raise corrupt(f"safetensors could not read it ({exc})") from None
    dtype = getattr(torch, header.dtype) if header.dtype else None
    states = CODECS[header.codec].from_tensors(tensors, dtype, header.version)
    codec_tensors = frozenset().union(*(impl.tensor_names for impl in CODECS.values()))
    others = {k: v for k, v in tensors.items() if k not in codec_tensors}
    return {"hidden_states": states, **others}, header.metadata


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
