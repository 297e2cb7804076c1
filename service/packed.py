"""hs-connectors' Mooncake layout: one raw object of 64-byte-aligned tensors, read
through a versioned manifest that travels beside it (in ``kv_transfer_params``).

speculators' trainer reads samples from Mooncake with hs-connectors'
``MooncakeTransfer``: it fetches the object named by the manifest's ``handle``, checks
its size against ``metadata.total_aligned_bytes`` and cuts each tensor out at the
manifest's ``offset``/``nbytes`` (``MooncakeHiddenStatesStore.get_sample``). An hsx
object in that layout is:

    [safetensors header of the object, padded to 64] [tensor] [pad] [tensor] [pad] ...

The header is the very header the object has on local disk or S3, with the same
``__metadata__`` (codec, layer ids, provenance); the tensors follow it in the header's
order, each at the next multiple of 64 (``hs_connectors.mooncake_store.packed_layout``'s
alignment). The manifest lists only the tensors, so a trainer never sees the header,
and the object is self-describing: :func:`to_safetensors` gives back the exact bytes
(the same SHA-256) the object has on any other backend, from the object alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.codecs import CorruptObjectError, parse_safetensors_header

#: hs-connectors' manifest version (``mooncake_store.VERSION``) this layout follows.
VERSION = 1
#: hs-connectors' tensor alignment (``mooncake_store._TENSOR_ALIGN``).
ALIGN = 64

#: safetensors' dtype names as torch spells them (the manifest's ``dtype``).
_TORCH_DTYPES = {
    "BOOL": "torch.bool",
    "U8": "torch.uint8",
    "I8": "torch.int8",
    "F8_E5M2": "torch.float8_e5m2",
    "F8_E4M3": "torch.float8_e4m3fn",
    "I16": "torch.int16",
    "U16": "torch.uint16",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "I32": "torch.int32",
    "U32": "torch.uint32",
    "F32": "torch.float32",
    "F64": "torch.float64",
    "I64": "torch.int64",
    "U64": "torch.uint64",
}


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class Packed:
    """An object in the Mooncake layout: its pieces (nothing copied) and its manifest."""

    parts: list[bytes | memoryview]
    manifest: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self.parts)


def pack(parts: Sequence[bytes | memoryview], handle: str) -> Packed:
    """The safetensors object ``parts`` ([header, tensor memory...], as
    ``service.codecs.safetensors_parts`` makes them) in the Mooncake layout.

    The tensors are not copied: the pieces are views of ``parts`` with zero padding
    between them. The manifest's ``metadata.sha256`` is left for the caller to add once
    the store has hashed what it published.
    """
    views = [memoryview(part).cast("B") for part in parts]
    length = int.from_bytes(views[0][:8], "little")
    header = views[0][: 8 + length]
    data = _Concat([views[0][8 + length :], *views[1:]])
    entries = _header_entries(header)
    if entries and entries[-1][4] != data.nbytes:
        raise ValueError(f"the header holds {entries[-1][4]} data bytes, the parts {data.nbytes}")
    out: list[bytes | memoryview] = [header]
    position = header.nbytes
    tensors: dict[str, Any] = {}
    for name, dtype, shape, begin, end in entries:
        offset = _align(position)
        if offset > position:
            out.append(bytes(offset - position))
        out.extend(data.slice(begin, end))
        tensors[name] = {"shape": shape, "dtype": dtype, "nbytes": end - begin, "offset": offset}
        position = offset + end - begin
    total = _align(position)
    if total > position:
        out.append(bytes(total - position))
    hidden = tensors.get("hidden_states", {}).get("shape") or [0]
    manifest = {
        "handle": handle,
        "version": VERSION,
        "tensors": tensors,
        "metadata": {
            "num_tokens": int(hidden[0]),
            "total_aligned_bytes": total,
            # Ours: the layout has the object's safetensors header in front of the
            # tensors (hs-connectors' readers ignore what the manifest does not list).
            "layout": "hsx-safetensors-header",
        },
    }
    return Packed(out, manifest)


def to_safetensors(data: bytes | memoryview) -> bytes:
    """The safetensors object a Mooncake-layout object holds (the bytes it would have
    on any other backend), or CorruptObjectError. Work is bounded by ``data``'s size."""
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise CorruptObjectError("not a packed hidden-state object: shorter than a header")
    length = int.from_bytes(view[:8], "little")
    if length > view.nbytes - 8:
        raise CorruptObjectError(
            f"not a packed hidden-state object: a header of {length} bytes in {view.nbytes}"
        )
    header = bytes(view[: 8 + length])
    pieces = [header]
    position = len(header)
    for _, _, _, begin, end in _header_entries(header):
        offset = _align(position)
        if offset + end - begin > view.nbytes:
            raise CorruptObjectError("not a packed hidden-state object: a tensor past its end")
        pieces.append(bytes(view[offset : offset + end - begin]))
        position = offset + end - begin
    if _align(position) != view.nbytes:
        raise CorruptObjectError(
            f"not a packed hidden-state object: {view.nbytes} bytes, the layout {_align(position)}"
        )
    return b"".join(pieces)


def _header_entries(header: bytes | memoryview) -> list[tuple[str, str, list[int], int, int]]:
    """(name, torch dtype, shape, begin, end) of each tensor of a safetensors header, in
    data order; begin and end are offsets in the data section. The header is checked as
    safetensors' reader checks a whole file (``codecs.parse_safetensors_header``)."""
    length = int.from_bytes(header[:8], "little")
    try:
        raw = json.loads(bytes(header[8 : 8 + length]))
        ends = [spec["data_offsets"][1] for n, spec in raw.items() if n != "__metadata__"]
        data_size = max((e for e in ends if type(e) is int), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        raise CorruptObjectError("not a hidden-state object: a malformed header") from None
    _, entries = parse_safetensors_header(header, len(header) + data_size)
    start = len(header)
    ordered = sorted(entries.items(), key=lambda item: item[1].begin)
    return [
        (name, _TORCH_DTYPES[e.dtype], list(e.shape), e.begin - start, e.end - start)
        for name, e in ordered
    ]


class _Concat:
    """Buffers read as one, sliced without copying where a slice lies in one buffer."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self.nbytes = sum(view.nbytes for view in views)

    def slice(self, begin: int, end: int) -> list[memoryview]:
        out, start = [], 0
        for view in self._views:
            stop = start + view.nbytes
            if stop > begin and start < end:
                out.append(view[max(begin - start, 0) : min(end, stop) - start])
            start = stop
        return out


def manifest_of(data: bytes | memoryview, handle: str) -> dict[str, Any]:
    """The manifest of a stored Mooncake-layout object (what the writer answered when it
    stored it), from the object alone; CorruptObjectError if it is not one."""
    view = memoryview(data).cast("B")
    st = to_safetensors(view)  # checks the whole layout
    length = int.from_bytes(st[:8], "little")
    rebuilt = pack([st[: 8 + length], st[8 + length :]], handle)
    rebuilt.manifest["metadata"]["sha256"] = hashlib.sha256(view).hexdigest()
    return rebuilt.manifest


def as_safetensors(data: bytes, container: str) -> bytes:
    """An object's bytes as read from a store with ``container`` (``Storage.container``)
    as the safetensors file it stands for."""
    return to_safetensors(data) if container == "packed" else data
