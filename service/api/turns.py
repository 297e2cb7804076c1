"""One conversation regenerated turn by turn, as token ids: no engine, no I/O.

:class:`TurnBuilder` holds the token ids of the conversation so far *as generated*
and asks the chat template only for what surrounds each generated answer:

- before turn ``j``: the template's text between the end of the previous turn and the
  generation prompt of this one (the next user, system or tool turns and the
  assistant's opening), the render of ``messages[:j]`` with the generation prompt
  past the render of everything up to the previous turn, encoded alone;
- after it: the template's end-of-turn text (what the render of ``messages[:j+1]``
  writes after the answer's text), whose first token is dropped when the model
  generated it itself (ChatML's ``<|im_end|>``).

Generated token ids are never re-tokenised, so the stored conversation is exactly
what the target produced. Each turn's supervised range covers its generated tokens
and its end-of-turn tokens (speculators' render boundary). A template that renders
earlier turns differently once a later one follows (one that drops earlier turns'
reasoning) has no single token sequence for the conversation: such a row is refused
(:class:`TurnError`), as is a conversation without a user turn or one whose turn does
not fit ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.masks import Span, render_text


class TurnError(ValueError):
    """This conversation cannot be regenerated; the message says why and where."""


@dataclass(frozen=True)
class Turn:
    """One regenerated assistant turn of the stored conversation."""

    #: Index of the assistant message in the regenerated conversation.
    message: int
    #: First token of the answer in the stored ids.
    start: int
    #: Tokens the target generated (the stop token included when it stopped).
    generated: int
    #: One past the turn's end-of-turn tokens: ``[start, end)`` is supervised.
    end: int
    #: vLLM's ``finish_reason``: ``stop`` (a stop token) or ``length`` (max_tokens).
    finish_reason: str
    #: Prompt tokens of this turn's request that the prefix cache held.
    cached_tokens: int = 0


def answer_targets(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of the assistant messages to regenerate: every one after the first user
    turn (an assistant message before it is context, as in the loss masks), plus a new
    one at the end when the conversation does not end with the assistant.

    Raises TurnError for a conversation without a user turn.
    """
    roles = [m.get("role") for m in messages]
    if "user" not in roles:
        raise TurnError("the conversation has no user turn: there is nothing to answer")
    first_user = roles.index("user")
    targets = [i for i, role in enumerate(roles) if role == "assistant" and i > first_user]
    if roles[-1] != "assistant":
        targets.append(len(roles))
    return targets


@dataclass
class TurnBuilder:
    """The token ids of a conversation being regenerated (see the module's docstring).

    Use: ``while not builder.done: prompt = builder.prompt(); builder.accept(...)``.
    """

    tokenizer: Any
    messages: list[dict[str, Any]]
    max_model_len: int
    targets: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    #: The template's text of everything up to the end of the last finished turn.
    text: str = ""
    _opened: str = ""
    _prompt: list[int] = field(default_factory=list)

    @classmethod
    def start(
        cls, tokenizer: Any, messages: Sequence[Mapping[str, Any]], max_model_len: int
    ) -> TurnBuilder:
        """A builder for ``messages`` (copied); TurnError for no user turn."""
        plain = [dict(m) for m in messages]
        targets = answer_targets(plain)
        if targets and targets[-1] == len(plain):
            plain.append({"role": "assistant", "content": ""})
        return cls(tokenizer, plain, max_model_len, targets)

    @property
    def done(self) -> bool:
        """Whether every assistant turn has been generated."""
        return len(self.turns) == len(self.targets)

    def prompt(self) -> list[int]:
        """The next turn's prompt: the ids so far, then the template's tokens up to and
        including the assistant's opening. TurnError when it cannot be rendered as an
        extension of the turns before, or leaves no room for an answer."""
        index = self.targets[len(self.turns)]
        opened = self._render(index, opened=True)
        if not opened.startswith(self.text):
            raise TurnError(
                f"messages[{index}]: the chat template renders the earlier turns "
                "differently once this one follows (it rewrites history, e.g. drops "
                "earlier turns' reasoning), so no single token sequence holds the "
                "conversation; regenerate its turns as separate rows"
            )
        prompt = self.ids + self._encode(opened[len(self.text) :])
        if len(prompt) + 1 > self.max_model_len:
            raise TurnError(
                f"messages[{index}]: the turn's prompt is {len(prompt)} tokens, which "
                f"leaves no room for an answer within max_model_len {self.max_model_len}"
            )
        self._opened, self._prompt = opened, prompt
        return prompt

    def room(self, wanted: int) -> int:
        """Tokens this turn may generate: ``wanted``, less what the stored conversation
        cannot hold (its end-of-turn tokens and the final request's one token)."""
        left = self.max_model_len - 1 - len(self._prompt) - self._end_of_turn_estimate()
        if left < 1:
            index = self.targets[len(self.turns)]
            raise TurnError(
                f"messages[{index}]: the turn's prompt is {len(self._prompt)} tokens, which "
                f"leaves no room for an answer within max_model_len {self.max_model_len}"
            )
        return min(wanted, left)

    def accept(self, generated: Sequence[int], finish_reason: str, cached_tokens: int = 0) -> None:
        """Record the answer the target generated for the turn :meth:`prompt` opened."""
        index = self.targets[len(self.turns)]
        tokens = list(generated)
        stopped = finish_reason == "stop" and bool(tokens)
        content = self.tokenizer.decode(
            tokens[:-1] if stopped else tokens, skip_special_tokens=False
        )
        self.messages[index] = {"role": "assistant", "content": content}
        closed = self._render(index + 1, opened=False)
        end_of_turn = self._encode(self._after_answer(index, closed, content))
        if stopped and end_of_turn and end_of_turn[0] == tokens[-1]:
            end_of_turn = end_of_turn[1:]  # the stop token the model wrote is the template's
        start = len(self._prompt)
        self.ids = self._prompt + tokens + end_of_turn
        self.spans.append((start, len(self.ids)))
        self.text = closed
        self.turns.append(
            Turn(index, start, len(tokens), len(self.ids), finish_reason, cached_tokens)
        )
        if len(self.ids) + 1 > self.max_model_len:
            raise TurnError(
                f"messages[{index}]: the regenerated conversation is {len(self.ids)} "
                f"tokens, over max_model_len {self.max_model_len} less the one token the "
                "extraction needs"
            )

    def _after_answer(self, index: int, closed: str, content: str) -> str:
        """The template's text after the answer in its render of the closed turn."""
        if not closed.startswith(self._opened):
            raise TurnError(
                f"messages[{index}]: the chat template opens a finished assistant turn "
                "differently from its generation prompt; no boundary can be derived"
            )
        rest = closed[len(self._opened) :]
        if rest.startswith(content):
            return rest[len(content) :]
        stripped = content.strip()  # templates that trim the content
        where = rest.find(stripped)
        if where < 0:
            raise TurnError(
                f"messages[{index}]: the chat template does not write the generated "
                "answer as it was generated; no boundary can be derived"
            )
        return rest[where + len(stripped) :]

    def _end_of_turn_estimate(self) -> int:
        """The end-of-turn tokens of an empty answer (what the budget reserves)."""
        index = self.targets[len(self.turns)]
        saved = self.messages[index]
        self.messages[index] = {"role": "assistant", "content": ""}
        try:
            rest = self._render(index + 1, opened=False)[len(self._opened) :]
        except TurnError:
            return 0
        finally:
            self.messages[index] = saved
        return len(self._encode(rest))

    def _render(self, end: int, *, opened: bool) -> str:
        try:
            return render_text(self.tokenizer, self.messages[:end], add_generation_prompt=opened)
        except Exception as exc:  # a template's own refusal (jinja raise_exception)
            raise TurnError(
                f"messages: the chat template cannot render the conversation up to "
                f"message {end - 1}: {type(exc).__name__}: {exc}"
            ) from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


def check_renderable(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], max_model_len: int
) -> None:
    """Refuse, before any generation, a conversation that cannot be regenerated: no user
    turn, a template that cannot render it (a tool turn it does not know), or turns
    that alone leave no room for an answer within ``max_model_len`` (TurnError)."""
    targets = answer_targets(messages)
    skeleton = [
        {"role": "assistant", "content": ""} if i in targets else dict(m)
        for i, m in enumerate(messages)
    ]
    if targets and targets[-1] == len(messages):
        skeleton.append({"role": "assistant", "content": ""})
    last = targets[-1]
    try:
        text = render_text(tokenizer, skeleton[:last], add_generation_prompt=True)
    except Exception as exc:
        raise TurnError(
            f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None
    try:
        length = len(tokenizer.encode(text, add_special_tokens=False))
    except Exception as exc:  # text no tokenizer takes (a lone surrogate)
        raise TurnError(f"its text cannot be tokenised: {type(exc).__name__}: {exc}") from None
    if length + 1 > max_model_len:
        raise TurnError(
            f"its turns alone are {length} tokens once rendered, which leaves no room "
            f"for an answer within max_model_len {max_model_len}"
        )
