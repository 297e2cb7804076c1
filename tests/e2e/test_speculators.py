"""speculators 0.9 run exactly as its users run it, against real hsx servers on 127.0.0.1.

``prepare-data`` renders through hsx's ``/v1/chat/completions/render``,
``generate-offline-data`` extracts through ``/v1/completions`` and moves the files,
and ``ArrowDataset`` reads the files or generates missing samples through hsx (local
disk with speculators' ``FileTransfer``, S3 with hsx's ``HsxTransfer``, Mooncake with
hs-connectors' ``MooncakeTransfer``: the online loop with no file in between).
speculators' clients send no API key (``EMPTY``), so these servers run open, as the
README says. The Mooncake tests run a real ``mooncake_master`` on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import torch
from safetensors.torch import load, load_file

from service.client import HsxClient, HsxError, HsxTransfer
from tests.api.conftest import ServerThread, as_extraction, objects_under
from tests.api.openai_helpers import counter, served_name, vllm_render
from tests.conftest import s3_settings
from tests.engine.checks import assert_object_matches
from tests.engine.conftest import engine_settings
from tests.engine.reference import relative_error
from tests.support.mooncake import mooncake_missing, running_master

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.system]
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


# -- Mooncake: the zero-disk feed -------------------------------------------------------

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Mooncake master on 127.0.0.1 (its store is hsx's writer's memory)."""
    reason = mooncake_missing()
    if reason is not None:
        pytest.skip(reason)
    with running_master(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@pytest.fixture(scope="module")
def mooncake_hsx(model_dir: Any, master: Any) -> Iterator[Any]:
    """An open hsx on the same model as ``local_hsx``, storing in Mooncake: its writer
    contributes the store's only memory, 16 MiB."""
    storage = {
        "mooncake": {
            "segment_bytes": 16 * MIB,
            "buffer_bytes": 8 * MIB,
            "metrics_url": master.metrics_url,
        }
    }
    thread = ServerThread(engine_settings(model_dir("llama"), master.url, storage=storage))
    thread.url = thread.serve(keys=None)  # type: ignore[attr-defined]
    yield thread
    thread.close()


def trainer_transfer(master: Any) -> Any:
    """hs-connectors' reader as speculators' trainer builds it (no memory of its own)."""
    from hs_connectors import MooncakeTransfer
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    config = MooncakeStoreConfig(
        local_hostname="127.0.0.1",
        master_server_address=master.address,
        global_segment_size=0,
        local_buffer_size=16 * MIB,
    )
    transfer = MooncakeTransfer(MooncakeHiddenStatesStore(config))
    transfer.setup()
    return transfer


def store_objects(master: Any) -> int:
    """Objects the whole Mooncake store holds, from its master's metrics."""
    text = httpx.get(master.metrics_url, timeout=5).text
    return int(
        next(line.split()[1] for line in text.splitlines() if line.startswith("master_key_count "))
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (fp8 has no torch.equal on the CPU)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


PROMPT_IDS = [[5, 17, 99, 3, 250, 11, 42], list(range(3, 160))]


def test_mooncake_objects_equal_local_disk_bit_for_bit(
    mooncake_hsx: Any, local_hsx: Any, master: Any
) -> None:
    """``/extract`` and ``/v1/completions`` on Mooncake: read by hs-connectors'
    ``MooncakeTransfer`` with the answered manifest, every tensor is the local-disk
    object's, bit for bit (``raw`` and ``fp8``), and ``GET /objects`` answers the same
    safetensors bytes as the file."""
    from hs_connectors import FP8Transfer
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    transfer = trainer_transfer(master)
    with HsxClient(mooncake_hsx.url) as moon, HsxClient(local_hsx.url) as disk:
        for codec in ("raw", "fp8"):
            for ids in PROMPT_IDS:  # one at a time: the same batches on both engines
                stored = moon.extract([ids], codec=codec).objects[0]
                local = disk.extract([ids], codec=codec).objects[0]
                manifest = stored.transfer
                assert manifest is not None
                assert manifest["version"] == 1
                assert manifest["handle"] == stored.key
                assert manifest["metadata"]["total_aligned_bytes"] == stored.bytes
                assert manifest["metadata"]["sha256"] == stored.sha256
                got = transfer.get_generated(manifest)
                path = Path(local.uri.removeprefix("file://"))
                expected = load_file(path)
                assert set(got) == set(expected)
                for name, tensor in expected.items():
                    assert same_bits(got[name], tensor), (codec, name)
                assert moon.get_object(stored.key) == path.read_bytes()
                if codec == "fp8":  # dequantized as hs-connectors' FP8Transfer does
                    states = dequantize_fp8_tensor(
                        got["hidden_states"], got["hidden_states_scales"], dtype=torch.bfloat16
                    )
                    fp8 = FP8Transfer(path.parent).get_generated({"hidden_states_path": str(path)})
                    assert fp8 is not None
                    assert torch.equal(states, fp8["hidden_states"])
                transfer.delete(manifest["handle"])  # what speculators' trainer does
                with pytest.raises(HsxError) as gone:
                    moon.get_object(stored.key)
                assert gone.value.status == 404
                disk.delete(local.key)
        # /v1/completions: kv_transfer_params are the manifest, as hs-connectors'
        # Mooncake connector answers them (no hidden_states_path to delete by).
        params = transfer_params_of(mooncake_hsx, PROMPT_IDS[1])
        local_params = transfer_params_of(local_hsx, PROMPT_IDS[1])
        assert "hidden_states_path" not in params
        got = transfer.get_generated(params)
        expected = load_file(local_params["hidden_states_path"])
        assert all(same_bits(got[n], t) for n, t in expected.items())
        transfer.delete(params["handle"])
        disk.delete(local_params["handle"])
    assert store_objects(master) == 0


def files_under(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if p.is_file()}


def test_arrow_dataset_generates_through_hsx_on_mooncake(
    generated: Path,
    prepared: Path,
    mooncake_hsx: Any,
    master: Any,
    work: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The online loop: speculators' ``ArrowDataset(on_missing="generate")`` asks hsx
    for every sample and reads it from Mooncake with ``MooncakeTransfer``; no file is
    written under any directory of this session, and the store is empty afterwards
    (the trainer deletes each sample once read)."""
    fresh = fresh_copy(prepared, work / "fresh-mooncake")
    ds = arrow_dataset(
        fresh,
        vllm_endpoint=f"{mooncake_hsx.url}/v1",
        on_missing="generate",
        transfer=trainer_transfer(master),
    )
    before_files = files_under(tmp_path_factory.getbasetemp())
    before = counter(mooncake_hsx.url, PROMPTS)
    assert_samples_equal_files(ds, generated, prepared)
    assert counter(mooncake_hsx.url, PROMPTS) - before == 6
    assert files_under(tmp_path_factory.getbasetemp()) == before_files
    assert not (fresh / "hidden_states").exists()
    assert store_objects(master) == 0


def labelled(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``url``'s /metrics that carry ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def store_series_settles(url: str, expected: int) -> float:
    """``hsx_storage_store_objects`` on ``url`` once it reads ``expected``, or as it
    reads after three of hsx's usage intervals: hsx reuses a reading of the master's
    metrics for ``USAGE_TTL_S``, so a scrape right after a change may show the reading
    of a scrape just before it."""
    from service.storage.mooncake import USAGE_TTL_S

    deadline = time.monotonic() + 3 * USAGE_TTL_S
    while (found := labelled(url, "hsx_storage_store_objects")) != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(USAGE_TTL_S / 4)
    return found


def test_a_full_store_refuses_with_507_and_a_delete_makes_room(
    mooncake_hsx: Any, master: Any
) -> None:
    """Filled by another writer, the store refuses hsx's write: a 507 ``storage_full``
    naming the way out, nothing stored, the refusal counted; once the filler is
    deleted the same request succeeds."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    filler = MooncakeDistributedStore()
    assert filler.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * MIB, "tcp", "", master.address) == 0
    config = ReplicateConfig()
    config.with_hard_pin = True
    keys: list[str] = []
    for size in (MIB, 64 * 1024, 4096):  # until not even 4 KiB fits
        while filler.put(f"filler-{len(keys)}", bytes(size), config) == 0:
            keys.append(f"filler-{len(keys)}")
    objects = store_objects(master)
    refused = labelled(mooncake_hsx.url, "hsx_storage_errors_total", operation="put", kind="full")
    body = {"prompts": [{"token_ids": PROMPT_IDS[1]}]}  # ~80 KiB of states
    try:
        full = httpx.post(f"{mooncake_hsx.url}/extract", json=body, timeout=60)
        assert full.status_code == 507, full.text
        error = full.json()["error"]
        assert error["type"] == "storage_full"
        assert "full" in full.json()["objects"][0]["error"]["message"]
        assert store_objects(master) == objects  # nothing half-written
        assert (
            labelled(mooncake_hsx.url, "hsx_storage_errors_total", operation="put", kind="full")
            == refused + 1
        )
        assert store_series_settles(mooncake_hsx.url, objects) == objects
    finally:
        for key in keys:
            filler.remove(key, True)
        filler.close()
    again = httpx.post(f"{mooncake_hsx.url}/extract", json=body, timeout=60)
    assert again.status_code == 200, again.text
    with HsxClient(mooncake_hsx.url) as moon:
        moon.delete(again.json()["objects"][0]["key"])


def test_a_killed_master_makes_ready_503_and_hsx_serves_once_it_is_back(
    mooncake_hsx: Any, master: Any
) -> None:
    """Last in the module: it kills the master (every object is gone with it)."""
    body = {"prompts": [{"token_ids": PROMPT_IDS[0]}]}
    master.kill()
    ready = wait_for_status(f"{mooncake_hsx.url}/ready", 503)
    assert ready.json() == {"status": "unavailable", "detail": "storage: unavailable"}
    down = httpx.post(f"{mooncake_hsx.url}/extract", json=body, timeout=120)
    assert down.status_code in (502, 503), down.text
    assert down.json()["error"]["type"] in ("storage_error", "engine_unavailable")
    master.restart()
    wait_for_status(f"{mooncake_hsx.url}/ready", 200)
    back = httpx.post(f"{mooncake_hsx.url}/extract", json=body, timeout=60)
    assert back.status_code == 200, back.text
    with HsxClient(mooncake_hsx.url) as moon:
        tensors = moon.get(back.json()["objects"][0]["key"])
    assert tensors["token_ids"].tolist() == PROMPT_IDS[0]


def wait_for_status(url: str, status: int, timeout_s: float = 60) -> httpx.Response:
    """The first answer of ``url`` with ``status`` (the readiness cache is 5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(url, timeout=30)
        if response.status_code == status or time.monotonic() > deadline:
            assert response.status_code == status, response.text
            return response
        time.sleep(0.5)
