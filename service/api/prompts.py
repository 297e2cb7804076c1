"""Bounds on a request's prompts from their size alone, before a token exists.

Tokenising is the one step whose cost a client picks: an 8 MB text took 20 s of CPU
and gigabytes of memory. So a text that cannot fit is refused from its size alone
(``check_text_sizes``): no token of the model is longer than ``max_token_bytes``
UTF-8 bytes, so a prompt of at most ``n`` tokens has at most ``n * max_token_bytes``
bytes of text. A chat prompt's text is everything a chat template can write of it
(``rendered_bytes``: every string, keys included, and every number of its messages,
tools, documents and template kwargs), plus one token per message (its role marker,
which every template writes), so 270k empty messages weigh 270k tokens, not 0 bytes;
and a request holds at most ``max_messages`` of them. Tokenising then runs prompt by
prompt and stops when told to (``service.api.tokenizing``).

The bounds are checked on the JSON the client sent, before the request model validates
it (``service.api.bounded_route``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

# Re-exported for service.api.openai_protocol, which still imports them from here.
from service.api.bounded_route import BoundedBodyRoute as BoundedBodyRoute
from service.api.bounded_route import Endpoint as Endpoint
from service.api.bounded_route import body_check as body_check
from service.api.errors import limit_error
from service.api.schemas import PromptObject
from service.config import LimitsSettings

if TYPE_CHECKING:
    from service.api.state import ApiState

log = logging.getLogger(__name__)

#: Bytes per token assumed when the tokenizer cannot list its vocabulary.
FALLBACK_TOKEN_BYTES = 1024


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


class TextSize(NamedTuple):
    """What one prompt would have rendered: UTF-8 bytes of text, and chat messages."""

    field: str
    bytes: int
    messages: int = 0


def rendered_bytes(value: Any) -> int:
    """UTF-8 bytes of every string (dict keys included) and the text of every number in
    ``value``, parsed JSON: all the renderer reads of it, which a template writes as
    text or with ``tojson``. No field list to keep up with vLLM's chat parser: content
    parts of every type, ``refusal``, ``thinking``, names, tool calls, tool schemas all
    count."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, int | float):  # bool too
            total += len(str(item))
    return total


def prompt_text_size(prompt: Any, field: str) -> TextSize:
    """An ``/extract`` prompt's text, as sent (a string or a JSON object) or validated."""
    if isinstance(prompt, PromptObject):
        prompt = prompt.model_dump(include={"text", "messages"}, exclude_none=True)
    if isinstance(prompt, str):
        return TextSize(field, rendered_bytes(prompt))
    if not isinstance(prompt, dict):
        return TextSize(field, 0)
    if isinstance(prompt.get("text"), str):
        return TextSize(f"{field}.text", rendered_bytes(prompt["text"]))
    messages = prompt.get("messages")
    if isinstance(messages, list) and messages:
        return TextSize(f"{field}.messages", rendered_bytes(messages), len(messages))
    return TextSize(field, 0)


def check_prompt_sizes(
    prompts: Sequence[Any],
    max_tokens: int,
    *,
    token_bytes: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> None:
    """Refuse ``/extract`` prompts (as sent or validated) whose messages are too many or
    whose text, from its size alone, cannot fit (422)."""
    check_message_count(sum(_message_count(p) for p in prompts), limits, "prompts")
    sizes = [prompt_text_size(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    check_text_sizes(
        sizes,
        max_tokens=max_tokens,
        token_bytes=token_bytes,
        max_model_len=max_model_len,
        limits=limits,
    )


def _message_count(prompt: Any) -> int:
    messages = prompt.get("messages") if isinstance(prompt, dict) else None
    if isinstance(prompt, PromptObject):
        messages = prompt.messages
    return len(messages) if isinstance(messages, list) else 0


def check_extract_body(raw: Any, state: ApiState) -> None:
    """``/extract``'s bounds on the JSON as sent, before validation (``body_check``):
    prompts, max_tokens, messages and text; malformed parts are left to validation."""
    prompts = raw.get("prompts") if isinstance(raw, dict) else None
    if not isinstance(prompts, list):
        return
    limits = state.settings.limits
    max_tokens = raw.get("max_tokens", 1)
    max_tokens = max_tokens if type(max_tokens) is int and max_tokens >= 1 else 1
    check_request_limits(len(prompts), max_tokens, limits)
    check_prompt_sizes(
        prompts,
        max_tokens,
        token_bytes=state.max_token_bytes,
        max_model_len=state.extractor.max_model_len,
        limits=limits,
    )


def check_message_count(messages: int, limits: LimitsSettings, field: str) -> None:
    """At most ``max_messages`` chat messages in a request (422 naming ``field``)."""
    if messages > limits.max_messages:
        raise limit_error(field, f"{messages} chat messages; at most {limits.max_messages}")


def check_text_sizes(
    sizes: Sequence[TextSize],
    *,
    max_tokens: int,
    token_bytes: int,
    max_model_len: int,
    limits: LimitsSettings,
) -> None:
    """Refuse prompts whose text cannot fit (422): a prompt of ``n`` tokens holds at most
    ``n * token_bytes`` bytes of text, and each chat message takes one token of its own.

    Shared by ``/extract`` and the OpenAI routes, whose renderer would otherwise
    tokenise whatever text a client sends.
    """
    per_prompt = max_model_len - max_tokens
    if token_bytes <= 0 or per_prompt < 1:
        return  # no tokenizer (text is refused later) or no room (tokenize_all says so)
    total = 0
    for index, size in enumerate(sizes):
        weight = size.bytes + size.messages * token_bytes
        if weight > per_prompt * token_bytes:
            raise limit_error(
                size.field,
                f"{_text(size)} cannot fit in {per_prompt} tokens (max_model_len "
                f"{max_model_len} minus max_tokens {max_tokens}; no token of this model is "
                f"longer than {token_bytes} bytes{_per_message(size)})",
                index=index,
            )
        total += weight
        if total > limits.max_total_tokens * token_bytes:
            raise limit_error(
                "prompts",
                f"more text than {limits.max_total_tokens} tokens can hold "
                f"(reached at prompt {index})",
                index=index,
            )


def _text(size: TextSize) -> str:
    text = f"{size.bytes} bytes of text"
    return f"{text} in {size.messages} messages" if size.messages else text


def _per_message(size: TextSize) -> str:
    return ", and each message takes a token of its own" if size.messages else ""


def check_request_limits(prompts: int, max_tokens: int, limits: LimitsSettings) -> None:
    """Limits that need no tokenizer: prompts per request and max_tokens."""
    if prompts > limits.max_prompts:
        raise limit_error("prompts", f"{prompts} prompts; at most {limits.max_prompts}")
    if max_tokens > limits.max_tokens:
        raise limit_error("max_tokens", f"{max_tokens}; at most {limits.max_tokens}")
