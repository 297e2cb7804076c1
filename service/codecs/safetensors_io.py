"""The safetensors file format, written and read without copying a tensor.

The writer (``safetensors_parts``) lays a file out byte for byte as
``safetensors.torch.save`` does; the reader (``read_safetensors_header``) is as strict as
safetensors' own and raises :class:`CorruptObjectError` for anything malformed, after
work bounded by the header's length. What the tensors mean (which codec wrote them, the
states' shape) is for ``service.codecs.decoding``; this module knows only the format.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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
#: safetensors' name of each torch dtype (``"bfloat16"`` -> ``"BF16"``).
ST_NAME = {torch_name: st for torch_name, st, _, _ in _SAFETENSORS_DTYPES}
_ST_RANK = {row[0]: rank for rank, row in enumerate(_SAFETENSORS_DTYPES)}
#: Bytes per element of each safetensors dtype.
_ST_SIZES = {st: size for _, st, size, _ in _SAFETENSORS_DTYPES}
#: The numpy dtype of each safetensors dtype (None: numpy has none).
ST_NUMPY = {st: numpy for _, st, _, numpy in _SAFETENSORS_DTYPES}
#: safetensors' own ceiling on the JSON header; its reader refuses a longer one.
MAX_HEADER_BYTES = 100_000_000


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of ``__metadata__``)."""
    return str(dtype).removeprefix("torch.")


# ==============================
# Writing
# ==============================


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
            "dtype": ST_NAME[dtype_name(tensor.dtype)],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        offset += view.nbytes
        views.append(view)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views]


# ==============================
# Reading
# ==============================


class CorruptObjectError(ValueError):
    """Bytes that are not a well-formed object: not safetensors, or not what the codec
    named in its metadata writes. The readers of ``service.codecs``
    (``read_metadata``, ``read_object``, ``decode``, ``to_raw``) raise it for any
    malformed input, after work bounded by the input's size, and nothing else (a
    ValueError, as for an unknown codec or version)."""


def corrupt(reason: str) -> CorruptObjectError:
    """The CorruptObjectError for bytes that are malformed for ``reason``."""
    return CorruptObjectError(f"not a well-formed hidden-state object: {reason}")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header, checked against the bytes it describes."""

    dtype: str
    """safetensors' dtype name (``F32``, ``U8``, ...)."""
    shape: tuple[int, ...]
    begin: int
    """Where its bytes start and end in the whole object (header included)."""
    end: int


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
        raise corrupt(f"{view.nbytes} bytes, shorter than a safetensors header length")
    length = int.from_bytes(view[:8], "little")
    if length > min(MAX_HEADER_BYTES, view.nbytes - 8):
        raise corrupt(f"a header of {length} bytes in an object of {view.nbytes}")
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
        raise corrupt(f"the header is not JSON ({type(exc).__name__})") from None
    if not isinstance(parsed, dict):
        raise corrupt(f"the header is a JSON {type(parsed).__name__}, not an object")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise corrupt("__metadata__ is not an object of strings")
    start, tensors = 8 + length, {}
    for name, spec in parsed.items():
        tensors[name] = _tensor_entry(name, spec, start)
    position = start
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise corrupt(f"tensor {name[:64]!r} does not start where the one before ends")
        position = entry.end
    if position != size:
        raise corrupt(f"the tensors hold {position - start} bytes, the object {size - start}")
    return metadata, tensors


def _tensor_entry(name: str, spec: Any, start: int) -> TensorEntry:
    label = f"tensor {name[:64]!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise corrupt(f"{label} is not described by dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in _ST_SIZES:
        raise corrupt(f"{label} has an unknown dtype {str(dtype)[:32]!r}")
    if not are_sizes(shape) or not are_sizes(offsets) or len(offsets) != 2:
        raise corrupt(f"{label}: shape and data_offsets must be non-negative integers")
    begin, end = offsets
    count = 1
    for size in shape:
        count *= size
    if end - begin != count * _ST_SIZES[dtype]:
        raise corrupt(f"{label}: {end - begin} bytes for shape {shape} of {dtype}")
    return TensorEntry(dtype, tuple(shape), start + begin, start + end)


def are_sizes(value: Any) -> bool:
    """Whether ``value`` (parsed JSON) is a list of non-negative integers."""
    return isinstance(value, list) and all(
        type(v) is int and v >= 0
        for v in value  # bool is not a size
    )
