"""Reading a stored object on the client: its tensors, whatever its codec."""

from __future__ import annotations

from typing import Any


def decode_tensors(data: bytes, codec: str) -> dict[str, Any]:
    """The object's tensors, its states in the model dtype whatever the codec."""
    if codec == "raw":
        from safetensors.torch import load

        return dict(load(data))
    from service.codecs import decode

    return dict(decode(data)[0])
