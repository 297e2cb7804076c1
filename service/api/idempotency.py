"""Idempotent prompts: a prompt with a ``custom_id`` is computed and stored at most once.

Its key is derived from everything that decides the object (``idempotent_key``) and
written create-only. Before the engine runs, the key is looked up: an object already
there is returned (``found``) once its stored token ids are checked against the
prompt's. Identical prompts in flight in this process share one engine run
(``service.api.singleflight``); across replicas, the create-only write refuses the second
writer, which then returns the first one's object.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service.api.schemas import ExtractRequest
from service.api.state import ApiState
from service.codecs import codec_of, stored_shape
from service.engine.errors import IdempotencyConflictError, StorageWriteError
from service.engine.wire import Extraction
from service.storage import NotFoundError, Storage
from service.storage.keys import idempotent_key

__all__ = ["Found", "IdempotencyConflictError", "as_found", "extract_once"]


class Found(Extraction):
    """An object stored earlier under the prompt's key; the engine did not run for it."""

    found: Literal[True] = True


async def extract_once(
    state: ApiState, body: ExtractRequest, custom_id: str, token_ids: list[int], **kwargs: Any
) -> Extraction:
    """The prompt's object: found under its key, or made now (at most once).

    ``kwargs`` are ``Extractor.extract``'s. Raises what it raises, and
    IdempotencyConflictError when the stored object holds other token ids.
    """
    extractor = state.extractor
    assert state.storage is not None
    key = idempotent_key(
        state.settings.storage.key_prefix,
        kwargs["namespace"],
        custom_id=custom_id,
        token_ids=token_ids,
        model=extractor.info.name,
        layer_ids=extractor.layer_ids,
        dtype=extractor.dtype,
        options={
            "loss": body.loss,
            "output_tokens": body.max_tokens if body.include_output_tokens else 0,
            # Only when asked for: keys of raw, all-layer objects stay what they were.
            **({"codec": body.codec} if body.codec not in (None, "raw") else {}),
            **({"layers": body.layers} if body.layers is not None else {}),
        },
    )
    check = _Check(state.storage, key, custom_id, token_ids, body.include_output_tokens)

    async def start() -> Extraction:
        found = await check.lookup()
        if found is not None:
            return found
        try:
            made: Extraction = await extractor.extract(token_ids, key=key, **kwargs)
            return made
        except StorageWriteError:
            found = await check.lookup()  # another replica wrote it first (create-only)
            if found is None:
                raise
            return found

    result, shared = await state.flights.run(key, start)
    return as_found(result) if shared else result


def as_found(extraction: Extraction) -> Found:
    """``extraction`` as seen by a caller that did not make it."""
    if isinstance(extraction, Found):
        return extraction
    return Found(**extraction.model_dump())


@dataclass
class _Check:
    storage: Storage
    key: str
    custom_id: str
    token_ids: Sequence[int]
    with_output: bool

    async def lookup(self) -> Found | None:
        """The stored object, if any, once its token ids are checked; else None."""
        try:
            data = await self.storage.get(self.key)
        except NotFoundError:
            return None
        try:
            header, tensors = _read_header(data)
            stored = _tensor(data, header, tensors, "token_ids", "<q")
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise IdempotencyConflictError(
                f"custom_id {self.custom_id[:64]!r}: the object stored under its key "
                f"{self.key} is not a readable hidden-state object ({exc}); it was not "
                "overwritten"
            ) from exc
        prompt = len(self.token_ids)
        if stored[:prompt] != list(self.token_ids) or (
            not self.with_output and len(stored) != prompt
        ):
            raise IdempotencyConflictError(
                f"custom_id {self.custom_id[:64]!r}: the object stored under its key "
                f"{self.key} holds {len(stored)} other token ids than this prompt's "
                f"{prompt}; it was not overwritten"
            )
        mask = _tensor(data, header, tensors, "loss_mask", "<B") if "loss_mask" in tensors else None
        meta = tensors.get("__metadata__") or {}
        return Found(
            key=self.key,
            uri=self.storage.uri(self.key),
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            num_tokens=len(stored),
            shape=stored_shape(tensors),
            codec=codec_of(meta),
            layer_ids=tuple(json.loads(meta.get("layer_ids", "[]"))),
            prompt_tokens=prompt,
            output_token_ids=tuple(stored[prompt:]),
            num_loss_tokens=sum(mask) if mask is not None else None,
        )


def _read_header(data: bytes) -> tuple[int, dict[str, Any]]:
    """safetensors: an 8-byte little-endian header length, then the JSON header."""
    (length,) = struct.unpack_from("<Q", data, 0)
    tensors: dict[str, Any] = json.loads(data[8 : 8 + length])
    return 8 + length, tensors


def _tensor(data: bytes, start: int, tensors: dict[str, Any], name: str, fmt: str) -> list[int]:
    begin, end = tensors[name]["data_offsets"]
    return [v for (v,) in struct.iter_unpack(fmt, data[start + begin : start + end])]
