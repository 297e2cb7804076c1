"""From request prompts to checked token ids, before anything reaches the engine."""

from __future__ import annotations

from typing import Any

from service.api.errors import ApiError
from service.api.schemas import ExtractRequest, Message, PromptObject
from service.config import LimitsSettings
from service.masks import conversation_ids


def check_request_limits(request: ExtractRequest, limits: LimitsSettings) -> None:
    """Limits that need no tokenizer: prompts per request and max_tokens."""
    if len(request.prompts) > limits.max_prompts:
        raise _limit("prompts", f"{len(request.prompts)} prompts; at most {limits.max_prompts}")
    if request.max_tokens > limits.max_tokens:
        raise _limit("max_tokens", f"{request.max_tokens}; at most {limits.max_tokens}")


def tokenize_all(
    request: ExtractRequest,
    tokenizer: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> list[list[int]]:
    """Token ids of every prompt; raises ApiError naming the prompt and field at fault."""
    per_prompt = max_model_len - request.max_tokens
    if per_prompt < 1:
        raise _limit(
            "max_tokens",
            f"{request.max_tokens} leaves no room for a prompt "
            f"within max_model_len {max_model_len}",
        )
    result, total = [], 0
    for index, prompt in enumerate(request.prompts):
        ids = _token_ids(prompt, tokenizer, vocab_size, index)
        if len(ids) > per_prompt:
            raise _limit(
                _field(prompt, index),
                f"{len(ids)} tokens; at most {per_prompt} (max_model_len {max_model_len} "
                f"minus max_tokens {request.max_tokens})",
                index=index,
            )
        total += len(ids)
        if total > limits.max_total_tokens:
            raise _limit(
                "prompts",
                f"more than {limits.max_total_tokens} tokens in total (reached at prompt {index})",
                index=index,
            )
        result.append(ids)
    return result


def _token_ids(
    prompt: str | PromptObject, tokenizer: Any, vocab_size: int, index: int
) -> list[int]:
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, index)
    elif prompt.text is not None:
        ids = _encode(tokenizer, prompt.text, index)
    elif prompt.messages is not None:
        ids = _render(tokenizer, prompt.messages, index)
    else:
        assert prompt.token_ids is not None
        ids = list(prompt.token_ids)
        bad = next((t for t in ids if vocab_size and t >= vocab_size), None)
        if bad is not None:
            raise ApiError(
                422,
                "invalid_request",
                f"prompts[{index}].token_ids: {bad} is not below the vocabulary size {vocab_size}",
                field=f"prompts[{index}].token_ids",
                index=index,
            )
    if not ids:
        raise ApiError(
            422,
            "invalid_request",
            f"prompts[{index}]: the prompt has no tokens",
            field=f"prompts[{index}]",
            index=index,
        )
    return ids


def _encode(tokenizer: Any, text: str, index: int) -> list[int]:
    if tokenizer is None:
        raise ApiError(
            422,
            "invalid_request",
            f"prompts[{index}]: this model serves token ids only (no tokenizer)",
            field=f"prompts[{index}]",
            index=index,
        )
    return list(tokenizer.encode(text))


def _render(tokenizer: Any, messages: list[Message], index: int) -> list[int]:
    field = f"prompts[{index}].messages"
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            422,
            "invalid_request",
            f"{field}: the model has no chat template",
            field=field,
            index=index,
        )
    # Complete conversations are stored as is, others get the assistant's turn opened;
    # the same render the loss masks are computed from (service.masks).
    return conversation_ids(tokenizer, [m.model_dump() for m in messages])


def _field(prompt: str | PromptObject, index: int) -> str:
    if isinstance(prompt, str):
        return f"prompts[{index}]"
    name = "text" if prompt.text is not None else "messages" if prompt.messages else "token_ids"
    return f"prompts[{index}].{name}"


def _limit(field: str, message: str, *, index: int | None = None) -> ApiError:
    return ApiError(422, "limit_exceeded", f"{field}: {message}", field=field, index=index)
