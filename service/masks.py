"""Loss masks for chat prompts, computed from the exact token ids the engine sees.

A drafter trainer (EAGLE-3 and kin) learns from the assistant's tokens only. The mask
is derived here, from the same renders that produce the stored ``token_ids``, so the
two can never drift apart. Two methods, in this order:

1. **Generation markers.** A chat template with ``{% generation %}`` blocks says which
   characters the assistant produced; transformers maps them onto tokens
   (``apply_chat_template(..., return_assistant_tokens_mask=True)``).
2. **Render boundaries** (the method of speculators' ``prepare-data``). For assistant
   turn ``j``, render ``messages[:j]`` with the generation prompt opened, and
   ``messages[:j+1]``; the supervised tokens are those by which the second extends
   the first. Where the generation prompt itself differs from the recorded turn (a
   pre-filled ``<think>`` scaffold), the boundary falls back to the common prefix,
   valid only if the history render agrees.

Each supervised turn's render must also be a prefix of the whole conversation's
render; otherwise the template renders that turn differently once later messages
follow (Qwen3's template drops earlier turns' reasoning, and writes an empty
``<think>`` block only on the final turn), and no mask over the stored tokens can be
derived for it: :class:`MaskError`. So is a conversation with no supervised token.
There is never a silent all-ones or all-zeros mask.

The renders follow ``/extract``: ``apply_chat_template(tokenize=False)`` then
``encode(add_special_tokens=False)`` (the template writes BOS and friends itself).
Render boundaries template every prefix they need, but tokenise the conversation
once: a prefix's tokens are the whole render's up to its last special token, plus the
rest encoded alone (:class:`PrefixEncoder`), so 600 turns cost 600 short encodes
instead of 600 ever longer ones (6 s of CPU before).
No vLLM import: this module needs only a Hugging Face tokenizer.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

LossMode = Literal["none", "assistant", "last_turn", "all"]
LOSS_MODES: tuple[LossMode, ...] = ("none", "assistant", "last_turn", "all")
Span = tuple[int, int]
Message = Mapping[str, Any]

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class MaskError(ValueError):
    """No trustworthy loss mask can be derived for this conversation."""


class NoSupervisedTokensError(MaskError):
    """The mask would supervise no token at all."""


@dataclass(frozen=True)
class MaskedPrompt:
    """A rendered conversation and its supervised token ranges ``[start, end)``."""

    token_ids: list[int]
    spans: tuple[Span, ...]
    method: Literal["generation_markers", "render_boundaries", "all"]

    @property
    def num_loss_tokens(self) -> int:
        """How many tokens the mask supervises."""
        return sum(end - start for start, end in self.spans)

    def mask(self) -> list[int]:
        """The mask, 0/1 per token, aligned with ``token_ids`` (not shifted)."""
        return spans_to_mask(self.spans, len(self.token_ids))


def spans_to_mask(spans: Sequence[Sequence[int]], num_tokens: int) -> list[int]:
    """0/1 per token from ``[start, end)`` ranges."""
    mask = [0] * num_tokens
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return mask


def mask_to_spans(mask: Sequence[int]) -> tuple[Span, ...]:
    """The ``[start, end)`` runs of ones in a 0/1 mask."""
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return tuple(spans)


def has_generation_markers(template: str | None) -> bool:
    """Whether a chat template marks the assistant's text with ``{% generation %}``."""
    return bool(template and _GENERATION_BLOCK.search(template))


def render_text(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """``messages`` rendered with the tokenizer's chat template, as text."""
    text: str = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    return text


def render_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    text = render_text(
        tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    return _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class PrefixEncoder:
    """Token ids of renders that share a prefix with one text, tokenised once.

    Hugging Face tokenizers split text at added (special) tokens before anything else
    and encode each piece alone, so a render equal to ``text`` up to some added token
    has ``text``'s tokens up to that token; only the rest, from that token on, needs
    encoding. ``encode(render)`` is ``tokenizer.encode(render)``, in the time of that
    rest (one turn) instead of the whole render. Tokenizers without offsets (slow
    ones) encode every render whole.
    """

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text
        self.ids: list[int]
        #: Each added token of ``text``: (its end, its start, its index in ``ids``).
        self.added: list[tuple[int, int, int]] = []
        if not getattr(tokenizer, "is_fast", False):
            self.ids = _encode(tokenizer, text)
            return
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        self.ids = list(out["input_ids"])
        added = {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()}
        for index, (token, (start, end)) in enumerate(
            zip(self.ids, out["offset_mapping"], strict=True)
        ):
            if token in added and text[start:end] == added[token]:
                self.added.append((end, start, index))
        self.ends = [end for end, _, _ in self.added]

    def encode(self, render: str) -> list[int]:
        last = self._last_shared(render)
        if last < 0:
            return _encode(self.tokenizer, render)
        _, start, index = self.added[last]
        return self.ids[:index] + _encode(self.tokenizer, render[start:])

    def _last_shared(self, render: str) -> int:
        """Index in ``added`` of the last added token ``render`` shares with ``text``."""
        if not self.added:
            return -1
        if self.text.startswith(render):
            return bisect_right(self.ends, len(render)) - 1
        low, high = 0, bisect_right(self.ends, len(render))
        while low < high:  # the shared prefix ends before the first token it lacks
            middle = (low + high) // 2
            if render.startswith(self.text[: self.ends[middle]]):
                low = middle + 1
            else:
                high = middle
        return low - 1


def conversation_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The ids ``/extract`` stores for a conversation.

    A conversation ending with the assistant is complete training data and is stored
    as is; otherwise the assistant's turn is opened, as a chat server would.
    """
    opened = messages[-1]["role"] != "assistant"
    return render_ids(tokenizer, messages, add_generation_prompt=opened, tools=tools)


def compute(
    tokenizer: Any,
    messages: Sequence[Message],
    loss: LossMode,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    allow_empty: bool = False,
) -> MaskedPrompt:
    """The token ids of ``messages`` and the mask ``loss`` asks for.

    ``assistant``: every assistant turn; ``last_turn``: the final assistant turn;
    ``all``: every token. Raises MaskError (unstable template), NoSupervisedTokensError
    (unless ``allow_empty``: the caller supervises other tokens, e.g. generated ones)
    and ValueError for ``none`` (no mask is wanted then).
    """
    if loss == "none" or loss not in LOSS_MODES:
        raise ValueError(f"loss {loss!r} asks for no mask")
    if not messages:
        raise MaskError("the conversation has no messages")
    if loss == "all":
        ids = conversation_ids(tokenizer, messages, tools)
        return MaskedPrompt(ids, ((0, len(ids)),) if ids else (), "all")
    if has_generation_markers(getattr(tokenizer, "chat_template", None)):
        masked = _from_markers(tokenizer, messages, loss, tools)
    else:
        masked = _from_boundaries(tokenizer, messages, loss, tools)
    if not masked.num_loss_tokens and not allow_empty:
        raise NoSupervisedTokensError(_no_tokens_reason(messages, loss, masked.method))
    return masked


def _from_markers(
    tokenizer: Any,
    messages: Sequence[Message],
    loss: LossMode,
    tools: Sequence[Mapping[str, Any]] | None,
) -> MaskedPrompt:
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=messages[-1]["role"] != "assistant",
    )
    ids = list(out["input_ids"])
    spans = mask_to_spans(out["assistant_masks"])
    if loss == "last_turn":
        spans = spans[-1:]  # the last generation block
    return MaskedPrompt(ids, spans, "generation_markers")


def _from_boundaries(
    tokenizer: Any,
    messages: Sequence[Message],
    loss: LossMode,
    tools: Sequence[Mapping[str, Any]] | None,
) -> MaskedPrompt:
    opened = messages[-1]["role"] != "assistant"
    whole = PrefixEncoder(
        tokenizer, render_text(tokenizer, messages, add_generation_prompt=opened, tools=tools)
    )
    # Turn 0 has no context to bound against: context only, as in speculators.
    turns = [j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0]
    if loss == "last_turn":
        turns = turns[-1:]
    spans = _boundary_spans(tokenizer, messages, turns, tools, whole.ids, whole.encode)
    if whole.added and turns and not _encodes_alike(tokenizer, messages, turns[-1], tools, whole):
        # A tokenizer whose pieces between added tokens are not encoded alone: every
        # render encoded whole (quadratic, within the message limit and the deadline).
        spans = _boundary_spans(
            tokenizer, messages, turns, tools, whole.ids, partial(_encode, tokenizer)
        )
    return MaskedPrompt(whole.ids, spans, "render_boundaries")


Encode = Callable[[str], list[int]]


def _boundary_spans(
    tokenizer: Any,
    messages: Sequence[Message],
    turns: Sequence[int],
    tools: Sequence[Mapping[str, Any]] | None,
    full: list[int],
    encode: Encode,
) -> tuple[Span, ...]:
    spans = []
    for j in turns:
        start, turn_ids = _turn_boundary(tokenizer, messages, j, tools, encode)
        if full[: len(turn_ids)] != turn_ids:
            raise MaskError(
                f"the chat template renders assistant turn {j} differently once later "
                "messages follow (it rewrites history, e.g. drops earlier turns' "
                "reasoning), so its tokens are not in the stored render; use "
                "loss='last_turn', or send each turn as its own prompt"
            )
        if len(turn_ids) > start:
            spans.append((start, len(turn_ids)))
    return tuple(spans)


def _encodes_alike(
    tokenizer: Any,
    messages: Sequence[Message],
    j: int,
    tools: Sequence[Mapping[str, Any]] | None,
    whole: PrefixEncoder,
) -> bool:
    """Whether ``whole.encode`` gives ``tokenizer.encode`` on turn ``j``'s renders."""
    renders = [
        render_text(tokenizer, messages[:j], add_generation_prompt=True, tools=tools),
        render_text(tokenizer, messages[: j + 1], add_generation_prompt=False, tools=tools),
    ]
    return all(whole.encode(r) == _encode(tokenizer, r) for r in renders)


def _turn_boundary(
    tokenizer: Any,
    messages: Sequence[Message],
    j: int,
    tools: Sequence[Mapping[str, Any]] | None,
    encode: Encode,
) -> tuple[int, list[int]]:
    """Where assistant turn ``j`` starts, and the render of ``messages[:j+1]``."""
    prompt = encode(render_text(tokenizer, messages[:j], add_generation_prompt=True, tools=tools))
    turn = encode(
        render_text(tokenizer, messages[: j + 1], add_generation_prompt=False, tools=tools)
    )
    if turn[: len(prompt)] == prompt:
        return len(prompt), turn
    # The generation prompt differs from the recorded turn (a pre-filled <think>
    # scaffold): the common prefix is the boundary, if the history itself agrees.
    boundary = _common_prefix_len(prompt, turn)
    history = encode(render_text(tokenizer, messages[:j], add_generation_prompt=False, tools=tools))
    if turn[: len(history)] != history or boundary < len(history):
        raise MaskError(
            f"the renders of the conversation up to assistant turn {j} with and without "
            "that turn diverge inside the history: the chat template is not prefix-stable"
        )
    return boundary, turn


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _no_tokens_reason(messages: Sequence[Message], loss: LossMode, method: str) -> str:
    roles = [m["role"] for m in messages]
    if "assistant" not in roles[1:]:
        return (
            f"loss={loss!r} supervises no token: the conversation has no assistant turn "
            "after the first message"
        )
    return f"loss={loss!r} supervises no token: the chat template's {method} mark none"
