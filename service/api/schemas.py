"""Request and response bodies of the HTTP API (also the OpenAPI schema).

The requests are defined here; the responses live in ``service.client.models`` (the
light client parses answers with them) and are re-exported from here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.client.models import (
    ErrorBody,
    ErrorDetail,
    ExtractResponse,
    ModelCard,
    ModelList,
    PartialFailureBody,
    PromptOutcome,
    Status,
    StoredObject,
    Usage,
    Version,
)
from service.codecs import Codec
from service.engine.objects import reserved_keys
from service.engine.wire import TokenSelection, TokenWindow
from service.masks import LossMode
from service.storage.expiry import MAX_TTL_S

#: Metadata key of a regenerated object (``service.api.regenerate``): set by the server.
REGENERATE_KEY = "hsx.regenerate"

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
MetadataValue = Annotated[str, StringConstraints(max_length=4096)]
#: Longest ``custom_id``; it is hashed into the key, never used as one.
MAX_CUSTOM_ID = 256


def _window_or_choice(value: Any, choice: ValidatorFunctionWrapHandler) -> Any:
    """An object is a window, validated as one: its errors name the window's field
    (``tokens.start``) instead of every union branch's (the named choices first, under
    a branch's name). Anything else must be one of the named choices."""
    if isinstance(value, dict):
        return TokenWindow.model_validate(value)
    try:
        return choice(value)
    except ValidationError:
        raise PydanticCustomError("token_selection", _SELECTION_CHOICES) from None


_SELECTION_CHOICES = (
    "Input should be 'all', 'last', 'mean', 'mean_loss' or a window object with "
    "integer start and end"
)


#: ``tokens`` of a request: a named selection, or an object that is a window.
TokenSelectionField = Annotated[TokenSelection, WrapValidator(_window_or_choice)]


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

#: Largest seed a regeneration takes (vLLM's per-request seed is a 64-bit integer).
MAX_SEED = (1 << 63) - 1


class Regenerate(BaseModel):
    """Replace every assistant turn of each ``messages`` prompt with the target's own
    answer, turn by turn, and store the regenerated conversation's states in one pass."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: int | None = Field(
        None, ge=1, description="Tokens each turn may generate. Default: the server's limit."
    )
    temperature: float = Field(
        0.0, ge=0.0, le=2.0, description="0: greedy (the default); else sampled."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="With the prompt's custom_id (or its messages' hash) it makes each "
        "row's seed, so a sampled run is reproducible.",
    )


def _regenerate_or_none(value: Any) -> Any:
    """``true`` is the defaults (greedy), ``false`` none; anything else as given."""
    if value is True:
        return {}
    return None if value is False else value


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
    ttl_s: int | None = Field(
        None,
        ge=1,
        le=MAX_TTL_S,
        description="Seconds the objects live (at most 366 days); then `GET` answers 404 "
        "and the store removes them. Default: the server's `storage.default_ttl_s` "
        "(unset: never expire).",
    )
    tokens: TokenSelectionField = Field(
        "all",
        description="Which token positions each object keeps: `all`; `last` (the last "
        "stored token); `mean` (one row, the mean over the prompt's tokens); `mean_loss` "
        "(the mean over the loss mask's tokens; needs `loss`); or a window "
        '`{"start": s, "end": e}`, `[s, e)` over the stored tokens, negative from the end. '
        "The object's `positions` tensor and `hsx.tokens` metadata record it.",
    )
    regenerate: Annotated[Regenerate | None, BeforeValidator(_regenerate_or_none)] = Field(
        None,
        description="`true` or sampling settings: each `messages` prompt's assistant "
        "turns are replaced by the target's own answers (the last user turn gets one), "
        "and the object holds the conversation's token ids as generated, with "
        "`loss: assistant` a mask over the generated and end-of-turn tokens, and the "
        "conversation in `objects[].regenerated`.",
    )
    return_: Literal["storage", "inline"] = Field(
        "storage",
        alias="return",
        description="`storage`: write each object and answer its key and uri. `inline`: "
        "answer each object's bytes (base64 safetensors, `objects[].data`) and write "
        "nothing; refused (422) when the objects (every tensor, and the header with the "
        "`metadata` in each) can take more than `limits.max_inline_bytes` together.",
    )

    @model_validator(mode="after")
    def _no_reserved_metadata(self) -> ExtractRequest:
        reserved = reserved_keys(self.metadata)
        if REGENERATE_KEY in self.metadata:  # what a regenerated object records of itself
            reserved.append(REGENERATE_KEY)
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


__all__ = [
    "MAX_CUSTOM_ID",
    "ErrorBody",
    "ErrorDetail",
    "ExtractRequest",
    "ExtractResponse",
    "Message",
    "MetadataKey",
    "MetadataValue",
    "ModelCard",
    "ModelList",
    "PartialFailureBody",
    "Prompt",
    "PromptObject",
    "PromptOutcome",
    "Regenerate",
    "Status",
    "StoredObject",
    "TokenSelectionField",
    "Usage",
    "Version",
]
