"""Reading a stored object on the client: its bytes (checked against the manifest),
its tensors whatever its codec, and its provenance.

A leaf of ``service.dataset``: ``verify``, ``parity`` and ``drift`` all read objects
through it, so none of them imports another to do so.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

import httpx

from service.client import AsyncHsxClient, HsxError
from service.codecs import read_metadata
from service.dataset.manifest import Job, Record

if TYPE_CHECKING:
    import torch

#: Prefix of the provenance keys in an object's ``__metadata__`` (``hsx.provenance.*``).
PROVENANCE_PREFIX = "hsx.provenance."


def decode_tensors(data: bytes, codec: str) -> dict[str, Any]:
    """The object's tensors, its states in the model dtype whatever the codec."""
    if codec == "raw":
        from safetensors.torch import load

        return dict(load(data))
    from service.codecs import decode

    return dict(decode(data)[0])


async def fetch(client: AsyncHsxClient, record: Record) -> tuple[bytes | None, str | None]:
    """The object's bytes, checked against the manifest's SHA-256, or the problem."""
    try:
        data = await client.get_object(record.key or "")
    except httpx.HTTPError as exc:
        return None, f"cannot read: {exc}"
    except HsxError as exc:
        return None, f"GET answered {exc.status}"
    if hashlib.sha256(data).hexdigest() != record.sha256:
        return None, "checksum differs from the manifest"
    return data, None


async def read_states(
    client: AsyncHsxClient, job: Job, record: Record
) -> tuple[torch.Tensor | None, list[int] | None, str | None]:
    """A row's decoded states [T, L, H] and token ids, or why they cannot be read."""
    data, problem = await fetch(client, record)
    if data is None:
        return None, None, problem
    try:
        tensors = await asyncio.to_thread(decode_tensors, data, job.fingerprint.codec)
    except Exception as exc:
        return None, None, f"not a safetensors object: {exc}"
    states, tokens = tensors.get("hidden_states"), tensors.get("token_ids")
    if states is None or tokens is None:
        return None, None, "no hidden_states or token_ids"
    return states, [int(t) for t in tokens.tolist()], None


def provenance_of(data: bytes) -> dict[str, str]:
    """The ``hsx.provenance.*`` entries of a safetensors object's ``__metadata__``
    (names without the prefix), read from its header alone."""
    return {
        k.removeprefix(PROVENANCE_PREFIX): v
        for k, v in read_metadata(data).items()
        if k.startswith(PROVENANCE_PREFIX)
    }
