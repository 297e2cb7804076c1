"""From request prompts to checked token ids, before anything reaches the engine.

Tokenising is the one step whose cost a client picks: an 8 MB text took 20 s of CPU
and gigabytes of memory. So a text that cannot fit is refused from its size alone
(``check_prompt_sizes``): no token of the model is longer than ``max_token_bytes``
UTF-8 bytes, so a prompt of at most ``n`` tokens has at most ``n * max_token_bytes``
bytes of text. Tokenising then runs prompt by prompt and stops when told to.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from service.api.errors import ApiError
from service.api.schemas import ExtractRequest, Message, PromptObject
from service.config import LimitsSettings
from service.masks import conversation_ids

log = logging.getLogger(__name__)

#: Bytes per token assumed when the tokenizer cannot list its vocabulary.
FALLBACK_TOKEN_BYTES = 1024


class TokenizingStopped(Exception):
    """Tokenising was stopped (the request's deadline passed, or it was cancelled)."""


def max_token_bytes(tokenizer: Any) -> int:
    """UTF-8 bytes of the model's longest token string: an upper bound on the text one
    token covers (byte-level BPE writes each byte as one character, SentencePiece its
    space as three bytes, byte-fallback tokens as six), so never an underestimate."""
    if tokenizer is None:
        return 0
    try:
        vocab = tokenizer.get_vocab()
        return max(len(str(token).encode()) for token in vocab) if vocab else 0
    except Exception:  # a tokenizer without a listable vocabulary: a loose bound
        log.warning("hsx: cannot list the tokenizer's vocabulary; assuming long tokens")
        return FALLBACK_TOKEN_BYTES


def check_prompt_sizes(
    request: ExtractRequest, *, token_bytes: int, max_model_len: int, limits: LimitsSettings
) -> None:
    """Refuse text and chat prompts whose size alone shows they cannot fit (422)."""
    sizes = [(_field(p, i), _text_bytes(p)) for i, p in enumerate(request.prompts)]
    check_text_sizes(
        sizes,
        max_tokens=request.max_tokens,
        token_bytes=token_bytes,
        max_model_len=max_model_len,
        limits=limits,
    )


def check_text_sizes(
    sizes: Sequence[tuple[str, int]],
    *,
    max_tokens: int,
    token_bytes: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> None:
    """Refuse prompts whose text, ``(field, UTF-8 bytes)`` each, cannot fit (422).

    Shared by ``/extract`` and the OpenAI routes, whose renderer would otherwise
    tokenise whatever text a client sends.
    """
    per_prompt = max_model_len - max_tokens
    if token_bytes <= 0 or per_prompt < 1:
        return  # no tokenizer (text is refused later) or no room (tokenize_all says so)
    total = 0
    for index, (field, size) in enumerate(sizes):
        if size > per_prompt * token_bytes:
            raise _limit(
                field,
                f"{size} bytes of text cannot fit in {per_prompt} tokens (max_model_len "
                f"{max_model_len} minus max_tokens {max_tokens}; no token of this "
                f"model is longer than {token_bytes} bytes)",
                index=index,
            )
        total += size
        if total > limits.max_total_tokens * token_bytes:
            raise _limit(
                "prompts",
                f"more text than {limits.max_total_tokens} tokens can hold "
                f"(reached at prompt {index})",
                index=index,
            )


def _text_bytes(prompt: str | PromptObject) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode())
    if prompt.text is not None:
        return len(prompt.text.encode())
    if prompt.messages is not None:
        return sum(len(m.content.encode()) for m in prompt.messages)
    return 0


def check_request_limits(prompts: int, max_tokens: int, limits: LimitsSettings) -> None:
    """Limits that need no tokenizer: prompts per request and max_tokens."""
    if prompts > limits.max_prompts:
        raise _limit("prompts", f"{prompts} prompts; at most {limits.max_prompts}")
    if max_tokens > limits.max_tokens:
        raise _limit("max_tokens", f"{max_tokens}; at most {limits.max_tokens}")


def tokenize_all(
    request: ExtractRequest,
    tokenizer: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    limits: LimitsSettings,
    stop: threading.Event | None = None,
) -> list[list[int]]:
    """Token ids of every prompt; raises ApiError naming the prompt and field at fault.

    Checks ``stop`` before each prompt and raises TokenizingStopped once it is set.
    """
    per_prompt = max_model_len - request.max_tokens
    if per_prompt < 1:
        raise _limit(
            "max_tokens",
            f"{request.max_tokens} leaves no room for a prompt "
            f"within max_model_len {max_model_len}",
        )
    result, total = [], 0
    for index, prompt in enumerate(request.prompts):
        if stop is not None and stop.is_set():
            raise TokenizingStopped
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
