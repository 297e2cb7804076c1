"""Loss masks on the real chat templates of three model families, no engine.

The templates (tests/masks/templates/) are loaded into the tiny test tokenizer, with the
special tokens they use added. Each test states the supervised text a trainer expects
(the assistant's content and its end-of-turn tokens as the template writes them) and
compares it with the tokens the mask selects, decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service import masks
from service.engine.tiny_models import make_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
SPECIAL = [
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
CHAT = [
    SYSTEM,
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "It is Rome."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(out, 512)
    return out


@pytest.fixture
def tokenizer(base_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tok


def use(tokenizer: Any, name: str) -> Any:
    tokenizer.chat_template = (TEMPLATES / name).read_text()
    return tokenizer


def supervised(tokenizer: Any, masked: masks.MaskedPrompt) -> list[str]:
    """The text of each run of supervised tokens."""
    mask = masked.mask()
    assert len(mask) == len(masked.token_ids)
    assert set(mask) <= {0, 1}
    return [tokenizer.decode(masked.token_ids[s:e]) for s, e in masks.mask_to_spans(mask)]


# -- Llama 3.1: header turns ending in <|eot_id|> ---------------------------------------


def test_llama_assistant_turns_with_system_prompt(tokenizer: Any) -> None:
    use(tokenizer, "llama3.1.jinja")
    masked = masks.compute(tokenizer, CHAT, "assistant")
    assert masked.method == "render_boundaries"
    assert supervised(tokenizer, masked) == [
        "The capital of France is Paris.<|eot_id|>",
        "It is Rome.<|eot_id|>",
    ]
    # The ids masked are the ids /extract stores for this conversation.
    assert masked.token_ids == masks.conversation_ids(tokenizer, CHAT)
    assert masked.num_loss_tokens == sum(masked.mask())


def test_llama_last_turn_and_all(tokenizer: Any) -> None:
    use(tokenizer, "llama3.1.jinja")
    last = masks.compute(tokenizer, CHAT, "last_turn")
    assert supervised(tokenizer, last) == ["It is Rome.<|eot_id|>"]
    every = masks.compute(tokenizer, CHAT, "all")
    assert every.token_ids == last.token_ids
    assert every.mask() == [1] * len(every.token_ids)


def test_llama_tool_calls(tokenizer: Any) -> None:
    use(tokenizer, "llama3.1.jinja")
    masked = masks.compute(tokenizer, TOOL_CHAT, "assistant", tools=TOOLS)
    assert supervised(tokenizer, masked) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is 18 C and sunny in Paris.<|eot_id|>",
    ]
    assert "get_weather" in tokenizer.decode(masked.token_ids[: masked.spans[0][0]])


def test_trailing_user_turn_is_context(tokenizer: Any) -> None:
    """A conversation ending with the user keeps the opened assistant header unsupervised."""
    use(tokenizer, "llama3.1.jinja")
    conv = [*CHAT, {"role": "user", "content": "And of Spain?"}]
    masked = masks.compute(tokenizer, conv, "assistant")
    assert supervised(tokenizer, masked)[-1] == "It is Rome.<|eot_id|>"
    text = tokenizer.decode(masked.token_ids)
    assert text.endswith("And of Spain?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


# -- Qwen3: ChatML with <think>, history reasoning dropped ----------------------------------


def test_qwen3_single_turn_with_reasoning(tokenizer: Any) -> None:
    use(tokenizer, "qwen3.jinja")
    conv = [
        SYSTEM,
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
    ]
    masked = masks.compute(tokenizer, conv, "assistant")
    assert supervised(tokenizer, masked) == ["<think>\nAdd them.\n</think>\n\nFour.<|im_end|>\n"]


def test_qwen3_multi_turn_last_turn(tokenizer: Any) -> None:
    """The final turn is rendered with its (empty) think block: that is what is stored."""
    use(tokenizer, "qwen3.jinja")
    masked = masks.compute(tokenizer, CHAT, "last_turn")
    assert supervised(tokenizer, masked) == ["<think>\n\n</think>\n\nIt is Rome.<|im_end|>\n"]
    # The earlier turn sits in the history without any think block.
    history = tokenizer.decode(masked.token_ids[: masked.spans[0][0]])
    assert "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>" in history


def test_qwen3_multi_turn_assistant_is_refused(tokenizer: Any) -> None:
    """Qwen3 renders a turn one way as the last message and another way as history: the
    turn's tokens are not in the stored render, so no mask of every turn exists."""
    use(tokenizer, "qwen3.jinja")
    with pytest.raises(masks.MaskError, match="assistant turn 2 differently"):
        masks.compute(tokenizer, CHAT, "assistant")


def test_qwen3_tool_calls_last_turn(tokenizer: Any) -> None:
    use(tokenizer, "qwen3.jinja")
    masked = masks.compute(tokenizer, TOOL_CHAT, "last_turn", tools=TOOLS)
    assert supervised(tokenizer, masked) == [
        "<think>\n\n</think>\n\nIt is 18 C and sunny in Paris.<|im_end|>\n"
    ]
    context = tokenizer.decode(masked.token_ids[: masked.spans[0][0]])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        context
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in context


# -- {% generation %} markers -----------------------------------------------------------------


def test_generation_markers(tokenizer: Any) -> None:
    use(tokenizer, "chatml_generation.jinja")
    assert masks.has_generation_markers(tokenizer.chat_template)
    masked = masks.compute(tokenizer, CHAT, "assistant")
    assert masked.method == "generation_markers"
    # The markers leave the newline after <|im_end|> out, unlike a render boundary.
    assert supervised(tokenizer, masked) == [
        "The capital of France is Paris.<|im_end|>",
        "It is Rome.<|im_end|>",
    ]
    assert masked.token_ids == masks.conversation_ids(tokenizer, CHAT)
    last = masks.compute(tokenizer, CHAT, "last_turn")
    assert supervised(tokenizer, last) == ["It is Rome.<|im_end|>"]


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["llama3.1.jinja", "qwen3.jinja", "chatml_generation.jinja"])
@pytest.mark.parametrize("loss", ["assistant", "last_turn"])
def test_no_assistant_turn_is_refused(tokenizer: Any, template: str, loss: Any) -> None:
    use(tokenizer, template)
    conv = [SYSTEM, {"role": "user", "content": "Hello"}]
    with pytest.raises(masks.MaskError, match="supervises no token"):
        masks.compute(tokenizer, conv, loss)


def test_unstable_template_is_refused(tokenizer: Any) -> None:
    """A template that writes the message count first changes every render's prefix."""
    tokenizer.chat_template = (
        "{{ messages | length }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(masks.MaskError, match="not prefix-stable"):
        masks.compute(tokenizer, CHAT, "assistant")


def test_none_is_not_a_mask(tokenizer: Any) -> None:
    use(tokenizer, "llama3.1.jinja")
    with pytest.raises(ValueError, match="no mask"):
        masks.compute(tokenizer, CHAT, "none")


# -- the same masks as speculators prepare-data ----------------------------------------------


@pytest.mark.parametrize(
    ("template", "conv", "tools"),
    [
        ("llama3.1.jinja", CHAT, None),
        ("llama3.1.jinja", TOOL_CHAT, TOOLS),
        ("qwen3.jinja", CHAT, None),
        ("qwen3.jinja", TOOL_CHAT, TOOLS),
    ],
)
def test_same_rows_as_speculators(
    tokenizer: Any,
    template: str,
    conv: list[dict[str, Any]],
    tools: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """speculators makes one row per assistant turn (the conversation up to it, masked at
    its render boundary): hsx's ``last_turn`` mask of that prefix, token for token.

    speculators renders through vLLM's HTTP render endpoint; here its render call is
    pointed at the same tokenizer, so the comparison is of the masking itself.
    """
    from speculators.data_generation import preprocessing

    use(tokenizer, template)

    def render(_endpoint: str, messages: Any, *, add_generation_prompt: bool, **kw: Any) -> Any:
        return masks.render_ids(
            tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=kw["tools"]
        )

    monkeypatch.setattr(preprocessing, "render_conversation", render)
    rows = preprocessing._render_boundary_rows(conv, "http://unused", 10**6, tools=tools)
    turns = [j for j, m in enumerate(conv) if m["role"] == "assistant" and j > 0]
    assert len(rows) == len(turns) == 2
    for j, row in zip(turns, rows, strict=True):
        ours = masks.compute(tokenizer, conv[: j + 1], "last_turn", tools=tools)
        assert ours.token_ids == row["input_ids"]
        assert ours.mask() == row["loss_mask"]


def test_mask_spans_round_trip() -> None:
    mask = [0, 1, 1, 0, 0, 1, 0, 1]
    assert masks.mask_to_spans(mask) == ((1, 3), (5, 6), (7, 8))
    assert masks.spans_to_mask(masks.mask_to_spans(mask), len(mask)) == mask
