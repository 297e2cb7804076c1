"""The typed boundary between hsx's processes.

Three messages cross it, each a pydantic model validated where it is read:

* :class:`ConnectorConfig`: API process -> EngineCore and workers, once, as vLLM's
  ``kv_connector_extra_config`` (built from settings in ``builder.py``, validated again
  in the connector's constructor).
* :class:`RequestParams`: per request, in ``SamplingParams.extra_args["hsx"]`` (vLLM
  ships extra_args as plain data, so it travels as a dict and is validated on the
  EngineCore side when the request finishes). New per-request options are fields with
  defaults here.
* :class:`Completion`: worker -> API process over the completion channel, one per
  object: the :class:`StoredObject` (holding the object's bytes when it is answered
  inline) or a :class:`WriteFailure`, plus the storage work the worker did since its
  last message (for ``/metrics``).

:class:`Extraction` (what ``Extractor.extract`` returns, and what the API answers from)
is the :class:`StoredObject` plus the engine's view of the prompt, so the object's
fields exist once. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.client.models import LayerStatistics
from service.codecs import Codec
from service.config import StorageSettings
from service.engine.provenance import Provenance
from service.masks import Span
from service.storage.base import StorageOp
from service.storage.expiry import MAX_TTL_S
from service.storage.keys import validate_key

#: Key of our per-request parameters in ``SamplingParams.extra_args``.
REQUEST_ARG = "hsx"
#: Bound of a token window's indices: past any context length, and small enough that
#: huge integers are refused by the schema rather than met in arithmetic.
MAX_TOKEN_INDEX = 1 << 31


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectorConfig(_Message):
    """What the connector needs from the API process's settings."""

    model_name: str
    """Served model name, written into every object's metadata."""
    completion_address: str
    """ZeroMQ address of the API process's completion receiver (``ipc://...``)."""
    completion_secret: str = Field(
        default_factory=lambda: secrets.token_hex(32), pattern="^[0-9a-f]{64}$", repr=False
    )
    """The key the writer tags each completion with (``service.engine.completion``),
    made by the API at each start. Default: a fresh one, which no receiver knows (a
    config built for anything but a serving engine)."""
    storage: StorageSettings
    """Where the worker writes objects."""
    max_bytes_in_flight: int = Field(ge=1)
    """Ceiling on bytes copied out of the KV cache and not yet durable."""
    storage_factory: str | None = None
    """``module:callable`` building the backend instead of the URL's (tests inject
    faults with it; a deployment may plug in its own store)."""
    provenance: Provenance | None = None
    """What makes the states, written into every object's metadata (built once at
    start-up in the API process, ``service.engine.provenance``); None: no fields."""

    def to_extra_config(self) -> dict[str, Any]:
        """Plain data for ``KVTransferConfig.kv_connector_extra_config``."""
        return self.model_dump(mode="json")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Validate what arrived in ``kv_connector_extra_config``."""
        return cls.model_validate(dict(extra))


class TokenWindow(_Message):
    """``[start, end)`` over the stored tokens; a negative index counts from the end."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    start: int = Field(ge=-MAX_TOKEN_INDEX, le=MAX_TOKEN_INDEX)
    end: int = Field(ge=-MAX_TOKEN_INDEX, le=MAX_TOKEN_INDEX)

    def bounds(self, num_stored: int) -> tuple[int, int]:
        """``[start, end)`` as absolute positions among ``num_stored`` tokens.

        Raises ValueError for a window that is empty or reaches outside them.
        """
        start = self.start + num_stored if self.start < 0 else self.start
        end = self.end + num_stored if self.end < 0 else self.end
        if not 0 <= start < end <= num_stored:
            raise ValueError(
                f"tokens: window [{self.start}, {self.end}) is empty or outside the "
                f"{num_stored} stored tokens"
            )
        return start, end


#: Which stored token positions an object keeps (``docs/design.md``, "Token selection").
TokenSelection = Literal["all", "last", "mean", "mean_loss"] | TokenWindow


def selected_positions(
    tokens: TokenSelection,
    num_prompt: int,
    num_stored: int,
    loss_spans: Sequence[tuple[int, int]] | None,
) -> tuple[int, ...] | None:
    """The stored positions ``tokens`` keeps (for ``mean``/``mean_loss``: those averaged
    over), or None for ``all``. ``loss_spans`` are over the stored tokens.

    Raises ValueError (naming ``tokens``) for a selection that keeps nothing.
    """
    if tokens == "all":
        return None
    if tokens == "last":
        positions: Sequence[int] = (num_stored - 1,) if num_stored else ()
    elif tokens == "mean":
        positions = range(num_prompt)
    elif tokens == "mean_loss":
        if loss_spans is None:
            raise ValueError("tokens: 'mean_loss' needs a loss mask (set loss)")
        positions = sorted({i for start, end in loss_spans for i in range(start, end)})
    else:
        positions = range(*tokens.bounds(num_stored))
    if not positions:
        raise ValueError(f"tokens: {selection_json(tokens)} selects no token")
    return tuple(positions)


def selection_json(tokens: TokenSelection) -> str:
    """The selection as JSON: what an object's ``hsx.tokens`` metadata records."""
    if isinstance(tokens, TokenWindow):
        return json.dumps({"start": tokens.start, "end": tokens.end})
    return json.dumps(tokens)


def is_pooled(tokens: TokenSelection) -> bool:
    """Whether the selection stores one mean row instead of the positions' rows."""
    return tokens in ("mean", "mean_loss")


class RequestParams(_Message):
    """hsx's parameters of one engine request (set by the Extractor, never by a client)."""

    key: str
    """Server-made object key the request's states are written under."""
    include_output_tokens: bool = False
    """Store the generated tokens' states too (all but the last, which has none)."""
    metadata: dict[str, str] = Field(default_factory=dict)
    """Caller's strings for the object's ``__metadata__`` (ours take precedence)."""
    loss_spans: tuple[Span, ...] | None = None
    """Supervised ``[start, end)`` ranges of the prompt's tokens: the object gets a
    ``loss_mask`` (generated tokens with states are supervised too). None: no mask."""
    codec: Codec = "raw"
    """How the object stores its states (``service.codecs``)."""
    layers: tuple[int, ...] | None = None
    """The served layer ids to store, in the server's order; None: all."""
    tokens: TokenSelection = "all"
    """Which stored token positions the object keeps (:func:`selected_positions`)."""
    inline_bytes: int | None = Field(None, ge=0)
    """Answer inline: the object's bytes come back in its completion, nothing is written
    to storage, and an object over this many bytes fails: its share of the request's
    ``limits.max_inline_bytes`` (``service.api.job``), never the whole limit. None: write
    to storage."""
    ttl_s: int | None = Field(None, ge=1, le=MAX_TTL_S)
    """Seconds the object lives from when the worker publishes it; None: forever."""

    @field_validator("key")
    @classmethod
    def _key_is_safe(cls, value: str) -> str:
        return validate_key(value)

    @field_validator("loss_spans")
    @classmethod
    def _spans_are_ranges(cls, value: tuple[Span, ...] | None) -> tuple[Span, ...] | None:
        for start, end in value or ():
            if not 0 <= start <= end:
                raise ValueError(f"loss span ({start}, {end}) is not a [start, end) range")
        return value

    def to_extra_args(self) -> dict[str, Any]:
        """``SamplingParams.extra_args`` carrying these parameters."""
        return {REQUEST_ARG: self.model_dump(mode="json")}

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> RequestParams | None:
        """The parameters in ``extra_args``; None for a request that is not hsx's.

        Raises pydantic.ValidationError when they are present but malformed.
        """
        raw = (extra_args or {}).get(REQUEST_ARG)
        return None if raw is None else cls.model_validate(raw)


class PackedTensor(_Message):
    """Where one tensor lies in a packed object (hs-connectors' ``packed_layout``)."""

    shape: tuple[int, ...]
    dtype: str
    """torch's name: ``torch.float32``."""
    nbytes: int
    offset: int


class TransferManifest(_Message):
    """hs-connectors' versioned Mooncake transfer manifest (``mooncake_store.VERSION``
    1): what ``MooncakeTransfer.get_generated`` reads an object with. ``metadata`` has
    ``num_tokens``, ``total_aligned_bytes`` (the object's size) and ``sha256`` (of the
    stored object)."""

    handle: str
    version: int
    tensors: dict[str, PackedTensor]
    metadata: dict[str, int | str]


class StoredObject(_Message):
    """One durable object: where it is, what it holds, what it took; or, answered
    inline (``RequestParams.inline_bytes``), the object itself in ``data``."""

    # The inline bytes cross the (JSON) completion channel as base64.
    model_config = ConfigDict(
        extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64"
    )

    key: str
    uri: str
    size: int
    """Bytes of the safetensors object."""
    sha256: str
    num_tokens: int
    shape: tuple[int, ...]
    """``hidden_states`` shape: [rows, num_layers, hidden_size]; rows is ``num_tokens``,
    or fewer under a token selection (``RequestParams.tokens``)."""
    num_loss_tokens: int | None = None
    """Tokens the stored ``loss_mask`` supervises; None when no mask was asked for."""
    layer_ids: tuple[int, ...] = ()
    """The layer ids the object holds, in order (``shape[1]`` of them)."""
    statistics: LayerStatistics | None = None
    """Per-layer sums of the states the writer stored, computed before any lossy codec
    (``service.engine.statistics``)."""
    copy_s: float = 0.0
    """Copy-out of the states from the KV cache to host memory."""
    write_s: float = 0.0
    """Validating, serialising and writing the object."""
    data: bytes | None = None
    """The object's bytes when answered inline (``uri`` is then empty and nothing is
    stored under ``key``); None for a stored object."""
    transfer: TransferManifest | None = None
    """For an object stored in hs-connectors' Mooncake layout (``service.packed``): the
    manifest its readers need; None on every other backend."""


FailureType = Literal[
    "storage_error", "storage_full", "invalid_hidden_states", "invalid_request", "internal_error"
]


class WriteFailure(_Message):
    """Why a prompt's object was not written (nothing is stored under its key)."""

    type: FailureType
    """The error type a caller sees (see ``service.engine.errors``)."""
    message: str
    reason: str | None = None
    """For ``invalid_hidden_states``: ``non_finite`` or ``all_zero_layer``."""


class Completion(_Message):
    """Worker -> API: the outcome of one object, exactly one of ``stored``/``failure``."""

    key: str
    stored: StoredObject | None = None
    failure: WriteFailure | None = None
    bytes_in_flight: int = 0
    """The writer's bytes in flight when this was sent (0 once idle)."""
    peak_bytes_in_flight: int = 0
    """The most bytes the writer has held in flight since it started."""
    storage_ops: tuple[StorageOp, ...] = ()
    """Storage calls the worker made since its previous completion."""

    @field_validator("key")
    @classmethod
    def _key_is_safe(cls, value: str) -> str:
        return validate_key(value)

    @model_validator(mode="after")
    def _one_outcome(self) -> Completion:
        if (self.stored is None) == (self.failure is None):
            raise ValueError("a completion has exactly one of stored or failure")
        if self.stored is not None and self.stored.key != self.key:
            raise ValueError("a completion's stored.key differs from its key")
        return self

    def encode(self) -> bytes:
        """The message's bytes on the channel (JSON)."""
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, raw: bytes) -> Completion:
        """Parse one message. Raises pydantic.ValidationError (a ValueError)."""
        return cls.model_validate_json(raw)


class WriterHello(_Message):
    """Worker -> API, once, when the writing rank's writer starts: proof that the
    completion channel reaches the API (start-up waits for it)."""

    writer_pid: int
    host: str


#: What the completion channel carries.
ChannelMessage = Completion | WriterHello


class Extraction(StoredObject):
    """One prompt's durable object and the engine's view of the prompt."""

    prompt_tokens: int
    """Tokens of the prompt the engine ran."""
    output_token_ids: tuple[int, ...] = ()
    """Tokens the engine generated (greedy)."""
    codec: str = "raw"
    """How the object stores its states (``service.codecs``)."""
    cached_tokens: int = 0
    """Prompt tokens vLLM's prefix cache held (its ``num_cached_tokens``): not computed
    again for this object."""


class Sampling(_Message):
    """How a plain generation (``Extractor.generate``, regeneration's turns) samples."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None


class Generated(_Message):
    """What a plain generation produced: the token ids exactly as sampled (the stop
    token included when the model stopped), why it stopped (vLLM's ``finish_reason``),
    and how many prompt tokens the prefix cache held."""

    token_ids: tuple[int, ...]
    finish_reason: str
    cached_tokens: int = 0
