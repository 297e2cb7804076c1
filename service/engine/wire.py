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
  object: the :class:`StoredObject` or a :class:`WriteFailure`, plus the storage work
  the worker did since its last message (for ``/metrics``).

:class:`Extraction` (what ``Extractor.extract`` returns, and what the API answers from)
is the :class:`StoredObject` plus the engine's view of the prompt, so the object's
fields exist once. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.client.models import LayerStatistics
from service.codecs import Codec
from service.config import StorageSettings
from service.engine.provenance import Provenance
from service.masks import Span
from service.storage.base import StorageOp
from service.storage.keys import validate_key

#: Key of our per-request parameters in ``SamplingParams.extra_args``.
REQUEST_ARG = "hsx"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectorConfig(_Message):
    """What the connector needs from the API process's settings."""

    model_name: str
    """Served model name, written into every object's metadata."""
    completion_address: str
    """ZeroMQ address of the API process's completion receiver (``ipc://...``)."""
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


class StoredObject(_Message):
    """One durable object: where it is, what it holds, what it took."""

    key: str
    uri: str
    size: int
    """Bytes of the safetensors object."""
    sha256: str
    num_tokens: int
    shape: tuple[int, ...]
    """``hidden_states`` shape: [num_tokens, num_layers, hidden_size]."""
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


FailureType = Literal["storage_error", "invalid_hidden_states", "invalid_request", "internal_error"]


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

    @model_validator(mode="after")
    def _one_outcome(self) -> Completion:
        if (self.stored is None) == (self.failure is None):
            raise ValueError("a completion has exactly one of stored or failure")
        return self

    def encode(self) -> bytes:
        """The message's bytes on the channel (JSON)."""
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, raw: bytes) -> Completion:
        """Parse one message. Raises pydantic.ValidationError (a ValueError)."""
        return cls.model_validate_json(raw)


class Extraction(StoredObject):
    """One prompt's durable object and the engine's view of the prompt."""

    prompt_tokens: int
    """Tokens of the prompt the engine ran."""
    output_token_ids: tuple[int, ...] = ()
    """Tokens the engine generated (greedy)."""
    codec: str = "raw"
    """How the object stores its states (``service.codecs``)."""
