"""The response bodies of hsx's HTTP API, shared by the server and its clients.

The server declares its responses with these models (``service.api.schemas``
re-exports them), and the clients parse answers into them, so one definition is the
wire format. They import only pydantic: a client needs neither vLLM nor FastAPI.

Each model also reads like the JSON it stands for (``answer["objects"][0]["key"]``),
so scripts written when ``HsxClient.extract`` returned a dict keep working.
"""

from __future__ import annotations

import base64
import builtins
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    """A response body that can also be read as its JSON object."""

    def __getitem__(self, name: str) -> Any:
        if name not in type(self).model_fields:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name``, or ``default`` for a name that is not a field."""
        return getattr(self, name) if name in type(self).model_fields else default


class LayerStatistics(_Body):
    """Sums over one object's stored states, per layer (lists follow ``shape[1]``), in
    float64, computed by the server from the states it stored (before any lossy codec).

    They add up across objects, so a run's statistics are the sums of its rows': mean
    ``sum / (num_tokens * hidden_size)``, variance from ``sum_sq``, mean token norm
    ``sum_token_norm / num_tokens``, fractions from the two counts.
    """

    num_tokens: int = Field(description="Token rows summed (the object's num_tokens).")
    hidden_size: int
    sum: list[float]
    sum_sq: list[float]
    sum_abs: list[float]
    max_abs: list[float] = Field(description="Largest |value| among the finite values.")
    sum_token_norm: list[float] = Field(description="Sum of the rows' L2 norms.")
    zero_rows: list[int] = Field(description="Token rows that are all zeros.")
    non_finite: list[int] = Field(description="Values that are NaN or infinite.")


class StoredObject(_Body):
    """One durable object."""

    index: int = Field(description="Position of the prompt in the request.")
    key: str
    uri: str
    num_tokens: int
    shape: list[int] = Field(description="[num_tokens, num_layers, hidden_size]")
    bytes: int = Field(description="Stored size: the encoded object's bytes.")
    sha256: str
    num_loss_tokens: int | None = Field(None, description="Supervised tokens (with loss).")
    status: Literal["created", "found"] = Field(
        "created", description="found: a prompt with this custom_id was stored before."
    )
    codec: str = Field("raw", description="How the object stores its states.")
    statistics: LayerStatistics | None = Field(
        None, description="Per-layer sums of the stored states (hsx dataset's statistics)."
    )
    data: str | None = Field(
        None,
        description="With `return: inline`: the object itself, safetensors bytes in base64 "
        "(nothing is stored: `uri` is empty). Absent for a stored object.",
    )
    transfer: dict[str, Any] | None = Field(
        None,
        description="With `mooncake://` storage: hs-connectors' versioned transfer manifest "
        "(handle, tensors' shapes, dtypes and offsets, total_aligned_bytes, sha256); "
        "`MooncakeTransfer.get_generated(transfer)` reads the object. Absent elsewhere.",
    )
    regenerated: dict[str, Any] | None = Field(
        None,
        description="With `regenerate`: the regenerated conversation (`messages`, "
        "`token_ids` as stored, `turns` with each answer's `[start, end)` span, generated "
        "tokens and finish reason), the seed, and the target's `forward_tokens` and "
        "`recomputed_tokens` for the row. Absent otherwise.",
    )

    def content(self) -> builtins.bytes:
        """The inline object's safetensors bytes; ValueError for a stored object (fetch
        those with the client's ``get_object``)."""
        if self.data is None:
            raise ValueError(f"object {self.index} was stored, not answered inline")
        return base64.b64decode(self.data, validate=True)

    def tensors(self) -> dict[str, Any]:
        """The inline object decoded (``service.codecs.decode``): ``hidden_states`` in
        the model dtype, ``token_ids`` and the others as stored. Needs torch."""
        from service.codecs import decode

        return decode(self.content())[0]


class Usage(_Body):
    prompt_tokens: int
    total_tokens: int


class ExtractResponse(_Body):
    """Every object listed here was durable when the response was sent."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "ext-0c6f9d0e2a4b4f0f8b1c3d5e7f9a1b2c",
                    "model": "tiny-llama",
                    "layer_ids": [2, 2, 1, 4],
                    "dtype": "float32",
                    "hidden_size": 128,
                    "objects": [
                        {
                            "index": 0,
                            "key": "hsx/default/2026/11/21/3f0c....safetensors",
                            "uri": "file:///srv/objects/hsx/default/2026/11/21/3f0c....safetensors",
                            "num_tokens": 6,
                            "shape": [6, 3, 128],
                            "bytes": 9392,
                            "sha256": "9b7c...",
                            "codec": "raw",
                        }
                    ],
                    "codecs": ["raw", "fp8", "bf16", "lossless"],
                    "usage": {"prompt_tokens": 6, "total_tokens": 7},
                }
            ]
        }
    )

    id: str
    model: str
    layer_ids: list[int] = Field(description="The layer ids the objects hold.")
    dtype: str
    hidden_size: int
    objects: list[StoredObject]
    codecs: list[str] = Field(description="The codecs this server offers.")
    usage: Usage


class ErrorDetail(_Body):
    type: str
    message: str
    field: str | None = None
    index: int | None = None


class ErrorBody(_Body):
    """The shape of every error response."""

    error: ErrorDetail


class PromptOutcome(_Body):
    """One prompt of a partly failed request: its key if written, else why not."""

    index: int
    key: str | None = None
    error: ErrorDetail | None = None


class PartialFailureBody(ErrorBody):
    """A 502/503 after some prompts' objects could not be written."""

    objects: list[PromptOutcome]


class ModelCard(_Body):
    """One served model: OpenAI's model object, plus what its objects hold."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hsx"
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    max_model_len: int
    storage_backend: str
    codecs: list[str] = Field(description="Codecs a request may ask for (`codec`).")
    default_codec: str = Field(description="The codec of requests that name none.")
    tokenizer_sha256: str | None = Field(None, description="SHA-256 of the tokenizer's JSON.")
    chat_template_sha256: str | None = Field(None, description="SHA-256 of the chat template.")
    provenance: dict[str, str] = Field(
        default_factory=dict,
        description="What made the states (hsx, vLLM and torch versions, the weights' "
        "SHA-256, the layer-id convention...): the same strings every object's "
        "__metadata__ carries under hsx.provenance.*.",
    )
    kv_cache: dict[str, int] | None = Field(
        None,
        description="KV capacity of one rank, the hidden-state layer included: `tokens` "
        "(as vLLM counts them), `memory_bytes`, `hidden_state_memory_bytes` (not sharded "
        "by tensor parallelism) and `bytes_per_token`.",
    )


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Version(_Body):
    version: str
    vllm: str


class Status(_Body):
    status: str
    detail: str | None = None


class Tokenized(_Body):
    """The part of vLLM's ``/tokenize`` answer a client reads: the token count."""

    model_config = ConfigDict(extra="allow")

    count: int
    max_model_len: int | None = None
    tokens: list[int] = Field(default_factory=list)
