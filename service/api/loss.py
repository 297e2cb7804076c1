"""Per-prompt loss masks (``loss`` on ``/extract``, or in a chat request's extra body), as
supervised ranges.

The ranges travel with the engine request and become the object's ``loss_mask``. They are
computed from the same render as the prompt's token ids (``service.masks``); a prompt
whose mask cannot be trusted is refused (422 on ``/extract``, 400 in the OpenAI dialect)
naming it and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.api.errors import ApiError
from service.api.messages import as_mapping, plain_message
from service.api.schemas import ExtractRequest
from service.masks import LossMode, MaskError, Span, compute

PromptSpans = tuple[Span, ...] | None


def loss_spans(
    body: ExtractRequest, tokenizer: Any, token_ids: list[list[int]]
) -> list[PromptSpans]:
    """Supervised ranges of each prompt's tokens; None everywhere for ``loss='none'``."""
    if body.loss == "none":
        return [None] * len(body.prompts)
    # Generated tokens count as supervised: a prompt with none of its own is fine then.
    generates = body.include_output_tokens and body.max_tokens > 1
    return [
        _prompt_spans(body, index, prompt, tokenizer, ids, allow_empty=generates)
        for index, (prompt, ids) in enumerate(zip(body.prompts, token_ids, strict=True))
    ]


def _prompt_spans(
    body: ExtractRequest,
    index: int,
    prompt: Any,
    tokenizer: Any,
    ids: list[int],
    *,
    allow_empty: bool,
) -> tuple[Span, ...]:
    messages = getattr(prompt, "messages", None)
    if messages is None:
        if body.loss == "all":
            return ((0, len(ids)),)
        raise _refuse(index, "prompts", f"loss={body.loss!r} needs a messages prompt")
    field = "messages"
    dicts = [m.model_dump() for m in messages]
    try:
        masked = compute(tokenizer, dicts, body.loss, allow_empty=allow_empty)
    except MaskError as exc:
        raise _refuse(index, field, f"loss={body.loss!r}: {exc}") from exc
    if masked.token_ids != ids:
        # Renders that are not deterministic (a template printing today's date).
        raise _refuse(
            index,
            field,
            "the chat template rendered this conversation twice "
            "differently; no mask can be aligned with its tokens",
        )
    return masked.spans


def _refuse(index: int, name: str, reason: str) -> ApiError:
    field = f"prompts[{index}]" if name == "prompts" else f"prompts[{index}].{name}"
    return ApiError(422, "invalid_request", f"{field}: {reason}", field=field, index=index)


def chat_spans(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    loss: LossMode,
    rendered: list[int],
) -> tuple[Span, ...]:
    """Supervised ranges of a chat request that vLLM's renderer made ``rendered`` of.

    The mask comes from ``service.masks`` renders of the same messages and tools; they
    must give ``rendered``, or a prefix of it when vLLM also opened the next assistant
    turn (``add_generation_prompt`` after a final assistant message: those tokens stay
    unsupervised). Anything else (a request ``chat_template``, template kwargs,
    ``continue_final_message``) would misalign the mask, so it raises MaskError.
    """
    plain = [plain_message(as_mapping(m)) for m in messages]
    masked = compute(tokenizer, plain, loss, tools=tools)
    if rendered[: len(masked.token_ids)] != masked.token_ids:
        raise MaskError(
            "the request renders differently from its conversation under the model's own "
            "chat template (a request chat_template, chat_template_kwargs or "
            "continue_final_message?); no mask can be aligned with its tokens"
        )
    return masked.spans
