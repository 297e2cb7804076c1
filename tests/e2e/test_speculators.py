"""speculators 0.9 run exactly as its users run it, against real hsx servers on 127.0.0.1.

``prepare-data`` renders through hsx's ``/v1/chat/completions/render``,
``generate-offline-data`` extracts through ``/v1/completions`` and moves the files,
and ``ArrowDataset`` reads the files or generates missing samples through hsx (local
disk with speculators' ``FileTransfer``, S3 with hsx's ``HsxTransfer``). speculators'
clients send no API key (``EMPTY``), so these servers run open, as the README says.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from safetensors.torch import load, load_file

from service.client import HsxClient, HsxTransfer
from tests.api.conftest import ServerThread, as_extraction, objects_under
from tests.api.openai_helpers import counter, served_name, vllm_render
from tests.conftest import s3_settings
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings
from tests.engine.reference import relative_error

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SEQ_LEN = 256
BUCKET = "hsx-speculators"
PROMPTS = "hsx_extract_prompts_total"  # prompts hsx ran through the engine

CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"from": "human", "value": "The quick brown fox?"},
        {"from": "gpt", "value": "Jumps over the lazy dog."},
        {"from": "human", "value": "And the hidden states?"},
        {"from": "gpt", "value": "The inputs of each decoder layer of a transformer."},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does speculative decoding do?"},
        {"role": "assistant", "content": "Drafts tokens with a small model and verifies them."},
        {"role": "user", "content": "Mamba layers?"},
        {"role": "assistant", "content": "Keep a recurrent state."},
    ],
    [
        {"from": "human", "value": "0123456789"},
        {"from": "gpt", "value": "!?.,;:"},
        {"from": "human", "value": "Attention layers keep a key-value cache."},
        {"from": "gpt", "value": "Yes."},
    ],
]


def speculators(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The ``speculators`` console script, as a user types it."""
    env = {**os.environ, "HF_HOME": str(cwd / "hf"), "HF_HUB_OFFLINE": "1"}
    script = Path(sys.executable).with_name("speculators")
    return subprocess.run(
        [str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def local_hsx(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An open hsx (no keys) writing to local disk; ``.url`` is its address."""
    root = tmp_path_factory.mktemp("spec-objects")
    thread = ServerThread(engine_settings(model_dir("llama"), str(root)))
    thread.root = root  # type: ignore[attr-defined]
    thread.url = thread.serve(keys=None)  # type: ignore[attr-defined]
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculators")


def prepare_data(hsx: Any, conversations: list[list[dict[str, str]]], work: Path) -> Path:
    """``speculators prepare-data`` on a JSONL of ``conversations``, rendering through the
    hsx server ``hsx`` (a ``ServerThread`` with ``.url``); the dataset's directory."""
    data = work / "conversations.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in conversations))
    out = work / "prepared"
    result = speculators(
        "prepare-data",
        "--model", str(hsx.settings.engine.model),
        "--data", str(data),
        "--render-endpoint", hsx.url,
        "--output", str(out),
        "--seq-length", str(SEQ_LEN),
        "--num-preprocessing-workers", "1",
        cwd=work,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Failed to process conversation" not in result.stderr
    return out


@pytest.fixture(scope="module")
def prepared(local_hsx: Any, work: Path) -> Path:
    """``speculators prepare-data`` on a JSONL of multi-turn conversations, through hsx."""
    return prepare_data(local_hsx, CONVERSATIONS, work)


def dataset(path: Path) -> list[dict[str, list[int]]]:
    from datasets import load_from_disk

    rows = load_from_disk(str(path)).with_format(None)
    return [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows]


def messages_of(conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation in OpenAI's roles, as prepare-data reads ShareGPT's from/value."""
    return [
        {
            "role": {"human": "user", "gpt": "assistant"}.get(
                turn.get("from", ""), turn.get("role", "")
            ),
            "content": turn.get("value") or turn.get("content", ""),
        }
        for turn in conversation
    ]


def assistant_turns() -> Iterator[tuple[list[dict[str, str]], int]]:
    """(messages, j) for each assistant turn j that prepare-data makes a row of: every
    one but a conversation's first message."""
    for conversation in CONVERSATIONS:
        messages = messages_of(conversation)
        for j, turn in enumerate(messages):
            if turn["role"] == "assistant" and j > 0:
                yield messages, j


def expected_rows(engine: ServerThread) -> list[dict[str, list[int]]]:
    """One row per assistant turn after the first message, from vLLM's own renderer:
    context (mask 0) is the conversation before the turn with the assistant's turn
    opened, the rest of the turn's full render is supervised (mask 1)."""
    rows = []
    for messages, j in assistant_turns():
        window = {"truncate_prompt_tokens": SEQ_LEN, "truncation_side": "right"}
        context = vllm_render(engine, messages=messages[:j], add_generation_prompt=True, **window)
        full = vllm_render(
            engine, messages=messages[: j + 1], add_generation_prompt=False, **window
        )
        assert full[: len(context)] == context  # the template is prefix-stable
        mask = [0] * len(context) + [1] * (len(full) - len(context))
        rows.append({"input_ids": full, "loss_mask": mask})
    return rows


def test_prepare_data_equals_vllms_renderer(prepared: Path, local_hsx: Any) -> None:
    """hsx renders with vLLM's renderer: the dataset equals a direct call of it."""
    rows = dataset(prepared)
    assert len(rows) == 6  # two assistant turns per conversation
    # prepare-data shuffles its rows (seeded): compare them in one order.
    assert sorted(rows, key=str) == sorted(expected_rows(local_hsx), key=str)


def test_extract_last_turn_masks_equal_prepare_data(prepared: Path, local_hsx: Any) -> None:
    """hsx's own masks (``/extract``, ``messages`` and ``loss: last_turn``) of each
    conversation up to an assistant turn are prepare-data's rows, token for token."""
    prompts = [{"messages": messages[: j + 1]} for messages, j in assistant_turns()]
    with HsxClient(local_hsx.url) as client:
        answer = client.extract(prompts, loss="last_turn")
        rows = []
        for obj in answer["objects"]:
            tensors = client.get(obj["key"])
            client.delete(obj["key"])  # generate-offline-data expects an empty storage
            mask = tensors["loss_mask"]
            assert mask.dtype == torch.uint8
            assert obj["num_loss_tokens"] == int(mask.sum()) > 0
            rows.append({"input_ids": tensors["token_ids"].tolist(), "loss_mask": mask.tolist()})
    # prepare-data shuffles its rows (seeded): compare them in one order.
    assert sorted(rows, key=str) == sorted(dataset(prepared), key=str)


@pytest.fixture(scope="module")
def generated(prepared: Path, local_hsx: Any, work: Path) -> Path:
    """``speculators generate-offline-data --validate-outputs`` against hsx."""
    before = counter(local_hsx.url, PROMPTS)
    result = generate(local_hsx.url, prepared, work)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Skipping sample" not in output
    assert "Saved 6 new data points" in output
    assert counter(local_hsx.url, PROMPTS) - before == 6  # one request per sample
    return prepared / "hidden_states"


def generate(url: str, prepared: Path, work: Path) -> subprocess.CompletedProcess[str]:
    return speculators(
        "generate-offline-data",
        "--endpoint", f"{url}/v1",
        "--preprocessed-data", str(prepared),
        "--validate-outputs",
        "--concurrency", "4",
        "--fail-on-error",
        cwd=work,
    )  # fmt: skip


def test_offline_files_equal_transformers(generated: Path, prepared: Path, local_hsx: Any) -> None:
    rows = dataset(prepared)
    assert sorted(p.name for p in generated.iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(rows))
    )
    model, layers = local_hsx.settings.engine.model, local_hsx.extractor.layer_ids
    for i, row in enumerate(rows):
        data = (generated / f"hs_{i}.safetensors").read_bytes()
        ids = row["input_ids"]
        shape = {"shape": [len(ids), len(layers), 128], "num_tokens": len(ids)}
        assert_object_matches(data, model, ids, layers, as_extraction(shape))
    # The files were moved out of hsx's storage, as from vLLM's: nothing is left there.
    assert objects_under(local_hsx.root, "default") == set()


def test_second_run_resumes_without_requests(
    generated: Path, prepared: Path, local_hsx: Any, work: Path
) -> None:
    before = counter(local_hsx.url, PROMPTS)
    assert generate(local_hsx.url, prepared, work).returncode == 0
    assert counter(local_hsx.url, PROMPTS) == before  # every sample was there
    kept = {i: (generated / f"hs_{i}.safetensors").read_bytes() for i in (1, 4)}
    for i in kept:
        (generated / f"hs_{i}.safetensors").unlink()
    assert generate(local_hsx.url, prepared, work).returncode == 0
    assert counter(local_hsx.url, PROMPTS) - before == 2  # only the missing two
    for i, data in kept.items():
        again, first = load_file(generated / f"hs_{i}.safetensors"), load(data)
        assert torch.equal(again["token_ids"], first["token_ids"])
        assert relative_error(again["hidden_states"], first["hidden_states"]) <= 1e-5


def arrow_dataset(datapath: Path, **kwargs: Any) -> Any:
    from speculators.train.data import ArrowDataset

    return ArrowDataset(
        max_len=SEQ_LEN, datapath=str(datapath), hidden_states_dtype=torch.float32, **kwargs
    )


def assert_samples_equal_files(ds: Any, generated: Path, prepared: Path) -> None:
    """Every sample: the ids of the dataset, the states of the offline files."""
    rows = dataset(prepared)
    assert len(ds) == len(rows)
    for i, row in enumerate(rows):
        sample = ds[i]
        assert isinstance(sample, dict), f"sample {i}: {sample}"
        assert sample["input_ids"].tolist() == row["input_ids"]
        assert sample["loss_mask"].tolist() == row["loss_mask"]
        states = load_file(generated / f"hs_{i}.safetensors")["hidden_states"]
        assert relative_error(sample["hidden_states"], states[:, :-1].flatten(1)) <= 1e-5
        assert relative_error(sample["verifier_last_hidden_states"], states[:, -1]) <= 1e-5


def test_arrow_dataset_reads_the_files(generated: Path, prepared: Path) -> None:
    ds = arrow_dataset(prepared, on_missing="raise")  # FileTransfer on hidden_states/
    assert_samples_equal_files(ds, generated, prepared)


def fresh_copy(prepared: Path, to: Path) -> Path:
    """The dataset without its hidden states: every sample must be generated."""
    shutil.copytree(prepared, to, ignore=shutil.ignore_patterns("hidden_states"))
    return to


def test_arrow_dataset_generates_through_hsx_on_local_disk(
    generated: Path, prepared: Path, local_hsx: Any, work: Path
) -> None:
    from hs_connectors import FileTransfer

    fresh = fresh_copy(prepared, work / "fresh-local")
    ds = arrow_dataset(
        fresh,
        vllm_endpoint=f"{local_hsx.url}/v1",
        on_missing="generate",
        transfer=FileTransfer(fresh / "hidden_states"),
    )
    before = counter(local_hsx.url, PROMPTS)
    assert_samples_equal_files(ds, generated, prepared)
    assert counter(local_hsx.url, PROMPTS) - before == 6
    assert objects_under(local_hsx.root, "default") == set()  # each read, then deleted


@pytest.fixture
def s3_hsx(model_dir: Any, s3_endpoint: str) -> Iterator[Any]:
    """An open hsx on the same model, writing to S3 (moto on 127.0.0.1)."""
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket=BUCKET
    )
    storage = s3_settings(s3_endpoint, BUCKET, prefix="spec").model_dump()
    thread = ServerThread(engine_settings(model_dir("llama"), storage.pop("url"), storage=storage))
    thread.url = thread.serve(keys=None)  # type: ignore[attr-defined]
    yield thread
    thread.close()


def transfer_params_of(hsx: Any, ids: list[int]) -> dict[str, Any]:
    import openai

    with openai.OpenAI(base_url=f"{hsx.url}/v1", api_key="EMPTY", max_retries=0) as client:
        done = client.completions.create(model=served_name(hsx), prompt=ids, max_tokens=1)
    return dict(done.model_extra["kv_transfer_params"])


def test_arrow_dataset_generates_through_hsx_on_s3(
    generated: Path, prepared: Path, s3_hsx: Any, s3_admin: Any, work: Path
) -> None:
    fresh = fresh_copy(prepared, work / "fresh-s3")
    transfer = HsxTransfer(s3_hsx.url)
    ds = arrow_dataset(
        fresh, vllm_endpoint=f"{s3_hsx.url}/v1", on_missing="generate", transfer=transfer
    )
    assert_samples_equal_files(ds, generated, prepared)
    assert counter(s3_hsx.url, PROMPTS) == 6
    # What speculators read: the object's s3:// URI as hidden_states_path, its key as handle.
    params = transfer_params_of(s3_hsx, ids=[5, 6, 7])
    assert params["hidden_states_path"] == f"s3://{BUCKET}/spec/{params['handle']}"
    transfer.get_generated(params)
    transfer.delete(params["hidden_states_path"])
    # Read through GET /objects (S3's presigned redirect), then deleted through the API.
    assert s3_admin.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0
    assert not (fresh / "hidden_states").exists()
