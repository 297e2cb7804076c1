"""Request and response bodies of the HTTP API (also the OpenAPI schema)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from service.codecs import Codec
from service.engine.objects import RESERVED_KEYS
from service.masks import LossMode

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
MetadataValue = Annotated[str, StringConstraints(max_length=4096)]
#: Longest ``custom_id``; it is hashed into the key, never used as one.
MAX_CUSTOM_ID = 256


class Message(BaseModel):
    """One chat message, rendered with the model's chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class PromptObject(BaseModel):
    """A prompt given as exactly one of text, token ids or chat messages."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"token_ids": [1, 2, 3]},
                {"messages": [{"role": "user", "content": "Hi"}]},
            ]
        },
    )

    text: str | None = Field(None, min_length=1)
    token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    messages: list[Message] | None = Field(None, min_length=1)
    custom_id: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CUSTOM_ID,
        description="Makes the prompt idempotent: a retry returns the stored object.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> PromptObject:
        given = [
            name for name in ("text", "token_ids", "messages") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of text, token_ids or messages")
        return self


Prompt = Annotated[str, StringConstraints(min_length=1)] | PromptObject


class ExtractRequest(BaseModel):
    """Prompts whose hidden states to extract, one object per prompt."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # "yes" is not a boolean, "5" not an integer
        json_schema_extra={
            "examples": [
                {"prompts": ["The capital of France is", {"token_ids": [1, 15, 27]}]},
                {
                    "prompts": [{"messages": [{"role": "user", "content": "Hello"}]}],
                    "max_tokens": 8,
                    "include_output_tokens": True,
                    "metadata": {"dataset": "sharegpt", "split": "train"},
                },
                {"prompts": ["Store these states small"], "codec": "fp8"},
            ]
        },
    )

    prompts: list[Prompt] = Field(
        min_length=1, description="Strings, or objects with one of text, token_ids, messages."
    )
    max_tokens: int = Field(1, ge=1, description="Tokens to generate per prompt.")
    include_output_tokens: bool = Field(
        False, description="Also store the generated tokens' states."
    )
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Strings stored in each object's __metadata__.",
    )
    loss: LossMode = Field(
        "none",
        description="Store a loss_mask: assistant turns, the last turn, all tokens, or none.",
    )
    codec: Codec | None = Field(
        None,
        description="How the objects store their states: `raw` (model dtype), `fp8` "
        "(float8 plus a float32 scale per token and layer, read by hs-connectors' "
        "FP8Transfer), `bf16` (float32 models only), `lossless` (bit-exact, zstd "
        "exponent plane). Default: the server's; `GET /v1/models` lists those offered.",
    )
    layers: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="Store only these layer ids: a subset of the served `layer_ids`, "
        "in their order. Default: all.",
    )

    @model_validator(mode="after")
    def _no_reserved_metadata(self) -> ExtractRequest:
        reserved = sorted(RESERVED_KEYS & self.metadata.keys())
        if reserved:
            raise ValueError(f"metadata keys {reserved} are reserved")
        return self

    @model_validator(mode="after")
    def _unique_custom_ids(self) -> ExtractRequest:
        seen: set[str] = set()
        for prompt in self.prompts:
            custom_id = getattr(prompt, "custom_id", None)
            if custom_id is not None and custom_id in seen:
                raise ValueError(f"custom_id {custom_id[:64]!r} appears twice in prompts")
            seen.add(custom_id or "")
        return self


class StoredObject(BaseModel):
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


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ExtractResponse(BaseModel):
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


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None
    index: int | None = None


class ErrorBody(BaseModel):
    """The shape of every error response."""

    error: ErrorDetail


class PromptOutcome(BaseModel):
    """One prompt of a partly failed request: its key if written, else why not."""

    index: int
    key: str | None = None
    error: ErrorDetail | None = None


class PartialFailureBody(ErrorBody):
    """A 502/503 after some prompts' objects could not be written."""

    objects: list[PromptOutcome]


class ModelCard(BaseModel):
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Version(BaseModel):
    version: str
    vllm: str


class Status(BaseModel):
    status: str
    detail: str | None = None
