"""From checked prompts to token ids, prompt by prompt, within the request's limits.

``tokenize_all`` encodes ``/extract``'s text prompts, renders its chat prompts (the
render the loss masks are computed from, ``service.masks``) and checks its token-id
prompts; ``check_token_ids`` checks the OpenAI routes' renders the same way. Each names
the prompt and field at fault (422), and tokenising stops when told to
(``TokenizingStopped``): it runs on the tokenizer pool (``service.api.pool``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from service.api.errors import ApiError, limit_error
from service.api.pool import TokenizingStopped
from service.api.schemas import ExtractRequest, Message, PromptObject
from service.config import LimitsSettings
from service.masks import conversation_ids


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
    prompts = [
        (_field(prompt, index), functools.partial(_token_ids, prompt, tokenizer, vocab_size, index))
        for index, prompt in enumerate(request.prompts)
    ]
    return _within_limits(prompts, request.max_tokens, max_model_len, limits, stop)


def check_token_ids(
    token_ids: Sequence[list[int]],
    max_tokens: int,
    *,
    vocab_size: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> list[list[int]]:
    """Prompts given as token ids (the OpenAI routes' renders), checked as ``/extract``
    checks ``token_ids`` prompts: the same limits, the same fields named."""
    prompts = [
        (f"prompts[{index}].token_ids", functools.partial(_checked_ids, ids, vocab_size, index))
        for index, ids in enumerate(token_ids)
    ]
    return _within_limits(prompts, max_tokens, max_model_len, limits)


def _within_limits(
    prompts: Sequence[tuple[str, Callable[[], list[int]]]],
    max_tokens: int,
    max_model_len: int,
    limits: LimitsSettings,
    stop: threading.Event | None = None,
) -> list[list[int]]:
    """Each prompt's token ids (``(field, ids)`` pairs), within ``max_model_len`` less
    ``max_tokens`` each and ``max_total_tokens`` in all."""
    per_prompt = max_model_len - max_tokens
    if per_prompt < 1:
        raise limit_error(
            "max_tokens",
            f"{max_tokens} leaves no room for a prompt within max_model_len {max_model_len}",
        )
    result, total = [], 0
    for index, (field, token_ids) in enumerate(prompts):
        if stop is not None and stop.is_set():
            raise TokenizingStopped
        ids = token_ids()
        if len(ids) > per_prompt:
            raise limit_error(
                field,
                f"{len(ids)} tokens; at most {per_prompt} (max_model_len {max_model_len} "
                f"minus max_tokens {max_tokens})",
                index=index,
            )
        total += len(ids)
        if total > limits.max_total_tokens:
            raise limit_error(
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
        return _checked_ids(prompt.token_ids, vocab_size, index)
    return _not_empty(ids, index)


def _checked_ids(token_ids: Sequence[int], vocab_size: int, index: int) -> list[int]:
    ids = list(token_ids)
    bad = next((t for t in ids if vocab_size and t >= vocab_size), None)
    if bad is not None:
        raise ApiError(
            422,
            "invalid_request",
            f"prompts[{index}].token_ids: {bad} is not below the vocabulary size {vocab_size}",
            field=f"prompts[{index}].token_ids",
            index=index,
        )
    return _not_empty(ids, index)


def _not_empty(ids: list[int], index: int) -> list[int]:
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
