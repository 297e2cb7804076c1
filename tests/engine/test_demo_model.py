"""The demo model (SmolLM2-135M-Instruct: a trained 30-layer Llama, hidden 576, ChatML
template, float32) behind one open hsx server for the whole module.

- Its stored states equal transformers' at EAGLE-3's default layers for 30 layers,
  ``[2, 15, 27, 30]``, under 32 concurrent requests of natural-language text and chat
  prompts, with chunked prefill forced (a 64-token budget, prompts up to ~300 tokens).
- Its loss masks on the real ChatML template equal the rows of speculators'
  ``prepare-data`` rendering through the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from tests.api.conftest import ServerThread, as_extraction
from tests.e2e.test_speculators import SEQ_LEN, dataset, messages_of, prepare_data
from tests.engine.checks import assert_object_matches, object_metadata
from tests.engine.conftest import engine_settings

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.system]

#: EAGLE-3's layers for a 30-layer model: [2, L//2, L-3, L].
EAGLE3_LAYERS = [2, 15, 27, 30]
HIDDEN = 576


# Natural-language prompts of varied length (5 to ~300 tokens once rendered).
PARAGRAPHS = [
    "The river runs slowly through the valley in late summer, and the farmers along its "
    "banks open their sluice gates one by one, so that the water reaches the lower fields "
    "before the heat of the afternoon.",
    "A lighthouse keeper once kept a logbook of every ship that passed. Over forty years "
    "the entries changed from sailing barques and steamers to container ships so large "
    "that they blotted out the horizon for a quarter of an hour.",
    "To bake bread, mix flour, water, salt and a little yeast, then knead the dough until "
    "it is smooth and springs back when pressed. Let it rise in a warm place, shape it, let "
    "it rise again, and bake it in a very hot oven until the crust sounds hollow.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The light "
    "reactions split water inside the thylakoid membranes, and the Calvin cycle then fixes "
    "carbon in the stroma, using the energy that the first stage stored in ATP and NADPH.",
    "In 1854 John Snow mapped the cholera deaths around Broad Street in London and noticed "
    "that they clustered around a single water pump. When the handle was removed, the "
    "outbreak, already waning, came to an end, and the map became a founding document of "
    "epidemiology.",
    "Good software tests are small, fast and independent: each one checks a single "
    "behaviour, fails for one reason only, and leaves nothing behind that could change the "
    "outcome of the next test. Slow tests are run less often and so catch bugs later.",
    "The violinist tuned her instrument in the wings while the orchestra settled. When she "
    "walked on, the hall went quiet, and the first long note of the concerto seemed to come "
    "from nowhere, rising over the strings like a bird lifting off a lake at dawn.",
    "Mountain weather changes quickly. Climbers are told to turn back at a fixed hour, "
    "whatever the distance left to the summit, because most accidents happen on the way "
    "down, when people are tired, the light is failing and the snow has softened.",
]

TEXTS = [
    "Hello!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    PARAGRAPHS[0],
    PARAGRAPHS[1],
    PARAGRAPHS[2],
    PARAGRAPHS[4],
    "Summarize the following text in one sentence. " + PARAGRAPHS[3],
    PARAGRAPHS[5] + " " + PARAGRAPHS[6],
    PARAGRAPHS[7] + "\n\n" + PARAGRAPHS[0] + "\n\n" + PARAGRAPHS[1],
    "Translate into French: " + PARAGRAPHS[6],
    " ".join(PARAGRAPHS[2:6]),
    " ".join(PARAGRAPHS[:6]),
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Question: why is the sky blue? Answer:",
    " ".join(reversed(PARAGRAPHS[1:6])),
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [{"role": "user", "content": "Explain this passage to a child: " + PARAGRAPHS[3]}],
    [
        {"role": "system", "content": "You are a patient baking teacher."},
        {"role": "user", "content": PARAGRAPHS[2] + " What did I forget?"},
    ],
    [
        {"role": "user", "content": "Tell me about John Snow."},
        {"role": "assistant", "content": PARAGRAPHS[4]},
        {"role": "user", "content": "Why was the map so important?"},
    ],
    [
        {"role": "user", "content": "Give me advice for climbing a mountain."},
        {"role": "assistant", "content": PARAGRAPHS[7]},
        {"role": "user", "content": "And what should I pack?"},
    ],
    [
        {"role": "system", "content": "Answer as a software engineer would."},
        {"role": "user", "content": "What makes a good test?"},
        {"role": "assistant", "content": PARAGRAPHS[5]},
        {"role": "user", "content": "How do I make slow tests faster?"},
    ],
    [{"role": "user", "content": "Continue the story: " + PARAGRAPHS[6] + " " + PARAGRAPHS[1]}],
    [
        {"role": "user", "content": "Compare these two texts.\n\n" + PARAGRAPHS[0]},
        {"role": "assistant", "content": "Sure, please send the second one."},
        {"role": "user", "content": PARAGRAPHS[7]},
    ],
    [{"role": "user", "content": "Thanks!"}],
    [
        {"role": "system", "content": "You are a historian."},
        {"role": "user", "content": " ".join(PARAGRAPHS[1:5]) + " Which of these is oldest?"},
    ],
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And times three?"},
    ],
    [{"role": "user", "content": "Proofread: " + " ".join(PARAGRAPHS[4:8])}],
    [
        {"role": "system", "content": "Reply in one word."},
        {"role": "user", "content": "Is water wet?"},
    ],
    [
        {"role": "user", "content": PARAGRAPHS[3]},
        {"role": "assistant", "content": PARAGRAPHS[2]},
        {"role": "user", "content": PARAGRAPHS[0]},
        {"role": "assistant", "content": PARAGRAPHS[6]},
        {"role": "user", "content": "Which of your answers was off topic?"},
    ],
]

# Multi-turn conversations for prepare-data: without a system message (SmolLM2's
# template then writes its default one), with one, and in ShareGPT's shape.
CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "user", "content": "What is a lighthouse for?"},
        {"role": "assistant", "content": "It warns ships of rocks and marks the coast."},
        {"role": "user", "content": "Are they still kept by people?"},
        {"role": "assistant", "content": "Mostly not: today nearly all are automated."},
    ],
    [
        {"role": "system", "content": "You are a friendly cooking assistant."},
        {"role": "user", "content": "How long should bread rise?"},
        {"role": "assistant", "content": "About an hour, until it doubles in size."},
        {"role": "user", "content": "And the second rise?"},
        {"role": "assistant", "content": "Shorter, thirty to forty-five minutes."},
        {"role": "user", "content": "Thank you!"},
        {"role": "assistant", "content": "You're welcome. Enjoy your bread!"},
    ],
    [
        {"from": "human", "value": "Who mapped the Broad Street cholera outbreak?"},
        {"from": "gpt", "value": "John Snow, a London physician, in 1854."},
        {"from": "human", "value": "What did he find?"},
        {"from": "gpt", "value": "The deaths clustered around one water pump."},
    ],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Why do climbers turn back at a fixed hour?"},
        {"role": "assistant", "content": "Because most accidents happen on the descent."},
        {"role": "user", "content": "Even close to the summit?"},
    ],
]


@pytest.fixture(scope="module")
def hsx(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One open hsx (no keys, namespace ``default``) on the demo model, writing to local
    disk; ``.url`` is its address. The engine's defaults pick the layers."""
    root = tmp_path_factory.mktemp("demo-objects")
    thread = ServerThread(engine_settings(demo_model, str(root)))
    thread.root = root  # type: ignore[attr-defined]
    thread.url = thread.serve(keys=None)  # type: ignore[attr-defined]
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    """The model's own tokenizer, loaded by transformers apart from the server's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], *, opened: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=opened, tokenize=True, return_dict=False
        )
    )


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """transformers' reference on one thread: on these 2 shared, busy cores two OpenMP
    threads ran it up to 15 times slower (the worst error was the same either way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


async def extract_concurrently(url: str, prompts: list[Any]) -> list[dict[str, Any]]:
    """One ``POST /extract`` per prompt, all in flight at once."""
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        responses = await asyncio.gather(
            *(client.post("/extract", json={"prompts": [p]}) for p in prompts)
        )
    for response in responses:
        assert response.status_code == 200, response.text
    return [r.json() for r in responses]


def test_concurrent_text_and_chat_prompts_equal_transformers(hsx: Any, tokenizer: Any) -> None:
    """32 concurrent requests (16 text, 16 ChatML conversations), chunked prefill forced:
    the stored ids are the tokenizer's (chat: ``apply_chat_template`` with the
    generation prompt), the states equal transformers' per layer to 1e-5."""
    assert hsx.settings.engine.max_num_batched_tokens == 64
    assert hsx.extractor.layer_ids == EAGLE3_LAYERS  # the default for 30 layers
    prompts: list[Any] = [{"text": t} for t in TEXTS] + [{"messages": m} for m in CHATS]
    expected = [tokenizer.encode(t) for t in TEXTS] + [
        chat_ids(tokenizer, m, opened=True) for m in CHATS
    ]
    lengths = sorted(len(ids) for ids in expected)
    assert len(prompts) == 32
    assert lengths[0] < 16, lengths
    assert 250 < lengths[-1] <= 320, lengths
    assert sum(n > 64 for n in lengths) >= 12, lengths  # several prefill chunks each

    answers = asyncio.run(extract_concurrently(hsx.url, prompts))
    model = hsx.settings.engine.model
    for answer, token_ids in zip(answers, expected, strict=True):
        assert answer["layer_ids"] == EAGLE3_LAYERS
        assert answer["hidden_size"] == HIDDEN
        assert answer["dtype"] == "float32"
        (obj,) = answer["objects"]
        assert obj["shape"] == [len(token_ids), len(EAGLE3_LAYERS), HIDDEN]
        data = (hsx.root / obj["key"]).read_bytes()
        assert object_metadata(data)["layer_ids"] == str(EAGLE3_LAYERS)
        with one_torch_thread():
            assert_object_matches(data, model, token_ids, EAGLE3_LAYERS, as_extraction(obj))
    assert not hsx.unfinished()


@pytest.fixture(scope="module")
def prepared(hsx: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[int]]]:
    """``speculators prepare-data`` on the conversations, rendering through hsx."""
    work = tmp_path_factory.mktemp("demo-speculators")
    return dataset(prepare_data(hsx, CONVERSATIONS, work))


def extract_masks(url: str, prompts: list[Any], loss: str) -> list[dict[str, list[int]]]:
    """``POST /extract`` with ``loss``: each object's ids and mask, in prompt order."""
    with httpx.Client(base_url=url, timeout=600) as client:
        response = client.post("/extract", json={"prompts": prompts, "loss": loss})
        assert response.status_code == 200, response.text
        rows = []
        for obj in response.json()["objects"]:
            tensors = load(client.get(f"/objects/{obj['key']}").content)
            mask = tensors["loss_mask"]
            assert mask.dtype == torch.uint8
            assert obj["num_loss_tokens"] == int(mask.sum()) > 0
            rows.append({"input_ids": tensors["token_ids"].tolist(), "loss_mask": mask.tolist()})
    return rows


def test_loss_masks_equal_prepare_data_rows(
    hsx: Any, tokenizer: Any, prepared: list[dict[str, list[int]]]
) -> None:
    """prepare-data makes one row per assistant turn ``j`` (after the first message):
    the render of ``messages[:j+1]``, only turn ``j`` supervised (its content and
    ``<|im_end|>\\n``). So, token for token:

    - ``loss: last_turn`` on each ``messages[:j+1]`` is that row;
    - ``loss: assistant`` on the whole conversation is the union (OR) of the
      conversation's rows, each a prefix of the whole render, zero-padded to its length
      (a conversation ending with the user is stored with the assistant turn opened,
      whose tokens are unsupervised).

    Conversations without a system message get SmolLM2's default system prompt from the
    template, in hsx's renders and in prepare-data's alike.
    """
    conversations = [messages_of(c) for c in CONVERSATIONS]
    turns = [
        (c, j)
        for c, messages in enumerate(conversations)
        for j, m in enumerate(messages)
        if m["role"] == "assistant" and j > 0
    ]
    assert len(prepared) == len(turns) == 8
    assert max(len(r["input_ids"]) for r in prepared) < SEQ_LEN  # nothing truncated

    # Each row is the tokenizer's render of the conversation up to its turn.
    renders = [chat_ids(tokenizer, conversations[c][: j + 1], opened=False) for c, j in turns]
    assert sorted(r["input_ids"] for r in prepared) == sorted(renders)
    default_system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    assert tokenizer.decode(renders[0]).startswith(default_system)  # conversation 0

    last_turn = extract_masks(
        hsx.url, [{"messages": conversations[c][: j + 1]} for c, j in turns], "last_turn"
    )
    # prepare-data shuffles its rows (seeded): compare them in one order.
    assert sorted(last_turn, key=str) == sorted(prepared, key=str)

    whole = extract_masks(hsx.url, [{"messages": m} for m in conversations], "assistant")
    for c, (messages, row) in enumerate(zip(conversations, whole, strict=True)):
        full = row["input_ids"]
        opened = messages[-1]["role"] != "assistant"
        assert full == chat_ids(tokenizer, messages, opened=opened)
        union = [0] * len(full)
        mine = [r for r in prepared if full[: len(r["input_ids"])] == r["input_ids"]]
        assert len(mine) == sum(1 for k, _ in turns if k == c)
        for r in mine:
            padded = r["loss_mask"] + [0] * (len(full) - len(r["loss_mask"]))
            union = [u | m for u, m in zip(union, padded, strict=True)]
        assert row["loss_mask"] == union, f"conversation {c}"
        # The supervised tokens are the assistant turns as the template writes them.
        supervised = [t for t, m in zip(full, row["loss_mask"], strict=True) if m]
        assert tokenizer.decode(supervised) == "".join(
            m["content"] + "<|im_end|>\n" for m in messages[1:] if m["role"] == "assistant"
        )


def test_regenerate_run_on_the_demo_model(hsx: Any, tokenizer: Any, tmp_path: Path) -> None:
    """``hsx dataset run --regenerate`` (greedy) on the conversations, then export:

    - each object's ids are the run's ``regenerated.jsonl`` ids, its answers what the
      engine generates greedily from the ids before them (SmolLM2 stops on
      ``<|im_end|>``, and the template's ``\\n`` closes the turn), its mask exactly
      the answers and their end-of-turn tokens;
    - its states equal a plain prefill of the same ids (prefix cache emptied) to 1e-5;
    - the conversations written render back, through the chat template, to the stored
      ids, or are listed (``render_drift``);
    - ``export --format speculators`` works on the run as on any other.
    """
    import json

    from service.cli import main
    from service.dataset import RunOptions, run_dataset
    from service.dataset.options import RegenerateSettings
    from service.dataset.regenerated import render_drift
    from tests.engine.regenerate_checks import check_turns, plain_prefill_error

    # Short answers: the demo model decodes slowly on these CPUs.
    rows = [{"messages": messages_of(c)} for c in CONVERSATIONS[-2:]]
    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    options = RunOptions(
        input=str(source),
        endpoints=[hsx.url],
        output=str(out),
        progress=False,
        batch_size=2,
        loss="assistant",
        regenerate=RegenerateSettings(max_tokens=16),
    )
    summary = run_dataset(options)
    assert summary.complete, summary
    assert summary.ok == len(rows), summary
    lines = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(line["row"] for line in lines) == list(range(len(rows)))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer.encode("\n")
    with httpx.Client(base_url=hsx.url, timeout=600) as client:
        for line in lines:
            ids, turns = line["token_ids"], line["turns"]
            tensors = load((hsx.root / line["key"]).read_bytes())
            assert tensors["token_ids"].tolist() == ids
            assert tensors["loss_mask"].tolist() == check_turns(hsx, ids, turns)
            for turn in turns:
                if turn["finish_reason"] == "stop":
                    last = turn["start"] + turn["generated"] - 1
                    assert ids[last] == end
                    assert ids[last + 1 : turn["end"]] == newline
            assert plain_prefill_error(hsx, client, ids, tensors["hidden_states"]) <= 1e-5
    drift = render_drift(tokenizer, {line["row"]: line for line in lines})
    rendered_back = [
        line
        for line in lines
        if chat_ids(tokenizer, line["messages"], opened=False) == line["token_ids"]
    ]
    print(f"hsx: regenerated rows rendering back to their ids: {len(rendered_back)}/{len(lines)}")
    assert len(drift) == len(lines) - len(rendered_back), drift
    assert len(rendered_back) >= len(lines) // 2, drift  # most answers re-tokenise alike
    dest = tmp_path / "export"
    assert main(["dataset", "export", str(out), str(dest), "--endpoint", hsx.url]) == 0
    assert len(list((dest / "hidden_states").glob("hs_*.safetensors"))) == len(rows)
