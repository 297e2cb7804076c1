"""Idempotent prompts: a prompt with a ``custom_id`` is computed and stored at most once.

What "the same ``custom_id``" means: a custom_id names one prompt of a namespace on the
served model (its name, layer ids and dtype). Its key is a hash of those alone
(``idempotent_key``), so every request naming it finds the same key, whatever else it
sends. The first request to store an object there decides what the custom_id stands
for; a later one gets that object (``found``) only if it asks for exactly that object:

* the same token ids (the stored ``token_ids`` start with the prompt's; they are the
  prompt's alone unless generated tokens are stored);
* the same ``codec`` (the server's default when none is named), ``layers`` (all the
  served ones when none are named), ``loss``, ``include_output_tokens`` and, with
  ``include_output_tokens``, ``max_tokens`` (without it, ``max_tokens`` changes
  nothing stored);
* the same ``tokens`` (the selection, as ``hsx.tokens`` writes it: a window is
  ``{"start", "end"}`` as sent, not what it resolves to) and the same ``ttl_s`` (the
  request's, or the server's default when it names none; None: never expires): a
  retry without a TTL must not be answered with an object that expires, nor one with
  a TTL with an object that never does (issue 58). The object expires when its first
  request said, counted from when it was stored, not from the retry;
* the same ``metadata``: the caller's strings stored in the object, no more, no less.

The object records the options above (all but the token ids and metadata) under
``hsx.request`` in its metadata.

Any other request is ``IdempotencyConflictError`` (409 ``conflict``) naming what
differs, and so is an object under the key that cannot be read as one (a malformed
header, a missing tensor, a missing or malformed ``hsx.request``, or one an older hsx
wrote without ``tokens`` and ``ttl_s``); the stored object is never touched.
Identical requests in flight in this process share one engine run
(``service.api.singleflight``); different ones do not: the extractor runs them one
after the other (``Extractor._one_at_a_time``), and the create-only write lets the
first store its object, the others then meeting it as above. Across replicas the
same: the create-only write refuses the second writer, which then reads the first's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from service.api.job import ExtractOptions
from service.api.loss import PromptSpans
from service.api.state import ApiState
from service.codecs import ObjectHeader, read_object
from service.engine.errors import IdempotencyConflictError, InvalidPromptError, StorageWriteError
from service.engine.objects import is_reserved
from service.engine.wire import Extraction, selection_json
from service.packed import as_safetensors, manifest_of
from service.storage import NotFoundError, Storage
from service.storage.keys import idempotent_key

__all__ = ["REQUEST_KEY", "Found", "IdempotencyConflictError", "as_found", "extract_once"]

#: Metadata key of the options an object under a custom_id was made with.
REQUEST_KEY = "hsx.request"
#: The options ``hsx.request`` records, in the order a conflict names them.
OPTIONS = ("codec", "layers", "loss", "include_output_tokens", "max_tokens", "tokens", "ttl_s")


class Found(Extraction):
    """An object stored earlier under the prompt's key; the engine did not run for it."""

    found: Literal[True] = True


def request_options(state: ApiState, options: ExtractOptions) -> dict[str, Any]:
    """What a request asks of an object besides its token ids and metadata, resolved the
    way the engine resolves it (the default codec, all served layers, the default TTL
    already in ``options.ttl_s``), as JSON values."""
    layers = state.extractor.layer_ids if options.layers is None else options.layers
    return {
        "codec": str(options.codec),
        "layers": list(layers),
        "loss": options.loss,
        "include_output_tokens": options.include_output_tokens,
        "max_tokens": options.max_tokens if options.include_output_tokens else None,
        "tokens": json.loads(selection_json(options.tokens)),
        "ttl_s": options.ttl_s,
    }


async def extract_once(
    state: ApiState,
    namespace: str,
    options: ExtractOptions,
    custom_id: str,
    token_ids: list[int],
    spans: PromptSpans,
) -> Extraction:
    """The prompt's object: found under its key, or made now (at most once).

    Raises what ``Extractor.extract`` raises, and IdempotencyConflictError when the
    stored object is not the one this request asks for (or cannot be read).
    """
    extractor = state.extractor
    metadata = dict(options.metadata)
    if REQUEST_KEY in metadata:
        raise InvalidPromptError(
            f"metadata: {REQUEST_KEY!r} is set by the server on prompts with a custom_id"
        )
    key = idempotent_key(
        state.settings.storage.key_prefix,
        namespace,
        custom_id=custom_id,
        model=extractor.info.name,
        layer_ids=extractor.layer_ids,
        dtype=extractor.dtype,
    )
    asked = request_options(state, options)
    check = _Check(state.storage, key, custom_id, token_ids, asked, metadata)
    recorded = json.dumps(asked, sort_keys=True, separators=(",", ":"))
    params = options.params(key, spans, {**metadata, REQUEST_KEY: recorded})

    async def start() -> Extraction:
        found = await check.lookup()
        if found is not None:
            return found
        try:
            return await extractor.extract(token_ids, params, max_tokens=options.max_tokens)
        except StorageWriteError:
            found = await check.lookup()  # another writer stored it first (create-only)
            if found is None:
                raise
            return found

    # Only identical requests share a run: another request for the same custom_id
    # must meet the stored object and be told how it differs, not inherit this one.
    request = json.dumps([token_ids, recorded, sorted(metadata.items())], separators=(",", ":"))
    flight = f"{key}#{hashlib.sha256(request.encode()).hexdigest()}"
    result, shared = await state.flights.run(flight, start)
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
    options: Mapping[str, Any]
    metadata: Mapping[str, str]

    async def lookup(self) -> Found | None:
        """The stored object, if any, once it is known to be the one this request asks
        for; None if there is none; IdempotencyConflictError otherwise."""
        try:
            stored_bytes = await self.storage.get(self.key)
        except NotFoundError:
            return None
        try:
            data = as_safetensors(stored_bytes, self.storage.container)
            header = read_object(data)
            stored = _integers(header, data, "token_ids", "<i8")
            mask = (
                _integers(header, data, "loss_mask", "u1")
                if "loss_mask" in header.tensors
                else None
            )
            options = _recorded_options(header.metadata)
        except ValueError as exc:  # CorruptObjectError, an unknown codec or version
            raise self._conflict(f"is not a readable hidden-state object ({exc})") from None
        differences = self._differences(stored, options, header.metadata)
        if differences:
            raise self._conflict(
                f"was stored by a request with {'; '.join(differences)}. A custom_id names "
                "one request: repeat it as it was to get the object, or use another custom_id"
            )
        prompt = len(self.token_ids)
        packed = self.storage.container == "packed"
        return Found(
            key=self.key,
            uri=self.storage.uri(self.key),
            size=len(stored_bytes),
            sha256=hashlib.sha256(stored_bytes).hexdigest(),
            transfer=manifest_of(stored_bytes, self.key) if packed else None,
            num_tokens=len(stored),
            shape=header.shape,
            codec=header.codec,
            layer_ids=header.layer_ids or tuple(options["layers"]),
            prompt_tokens=prompt,
            output_token_ids=tuple(stored[prompt:]),
            num_loss_tokens=sum(mask) if mask is not None else None,
        )

    def _differences(
        self, stored: list[int], options: Mapping[str, Any], metadata: Mapping[str, str]
    ) -> list[str]:
        """What differs between the stored object and this request, each named."""
        found = []
        prompt = list(self.token_ids)
        generated = self.options["include_output_tokens"]
        if stored[: len(prompt)] != prompt or (len(stored) != len(prompt) and not generated):
            found.append(f"other token ids ({len(stored)} stored, {len(prompt)} in this prompt)")
        for name in OPTIONS:
            if options[name] != self.options[name]:
                found.append(
                    f"other {name} ({options[name]!r} stored, {self.options[name]!r} asked)"
                )
        callers = {k: v for k, v in metadata.items() if not is_reserved(k) and k != REQUEST_KEY}
        if callers != dict(self.metadata):
            keys = sorted(
                k
                for k in callers.keys() | self.metadata.keys()
                if callers.get(k) != self.metadata.get(k)
            )
            found.append(
                f"other metadata (keys {', '.join(repr(k[:64]) for k in keys[:8])} differ)"
            )
        return found

    def _conflict(self, what: str) -> IdempotencyConflictError:
        return IdempotencyConflictError(
            f"custom_id {self.custom_id[:64]!r}: the object stored under its key {self.key} "
            f"{what}; it was not overwritten"
        )


def _integers(header: ObjectHeader, data: bytes, name: str, dtype: str) -> list[int]:
    """A one-dimensional integer tensor of the object (its header already checked)."""
    values: list[int] = np.frombuffer(header.bytes_of(data, name), dtype=np.dtype(dtype)).tolist()
    return values


def _recorded_options(metadata: Mapping[str, str]) -> dict[str, Any]:
    """The options an object under a custom_id records (``hsx.request``); ValueError
    when they are missing or malformed."""
    text = metadata.get(REQUEST_KEY)
    if text is None:
        raise ValueError(f"it has no {REQUEST_KEY!r} metadata")
    try:
        options = json.loads(text)
    except (ValueError, RecursionError):
        options = None
    if not isinstance(options, dict) or not set(options) <= set(OPTIONS):
        raise ValueError(f"its {REQUEST_KEY!r} metadata is not the options of a request")
    missing = [name for name in OPTIONS if name not in options]
    if missing:  # an older hsx's record: it cannot say which object it is
        raise ValueError(f"its {REQUEST_KEY!r} metadata does not record {', '.join(missing)}")
    return options
