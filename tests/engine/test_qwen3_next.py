"""Qwen3-Next (GatedDeltaNet linear attention + full attention, a mixture of experts) in
bfloat16, the only dtype vLLM's CPU GatedDeltaNet runs: states as close to transformers'
float32 ones as transformers' own bfloat16 are (``checks.assert_within_bf16_gap``).

One engine for the module, with a cache of a few sequences (chunked prefill is on: a
64-token budget, ``engine_settings``); its last test puts hsx's app in front of it, on
a real uvicorn server, for ``hsx dataset run`` and ``hsx dataset verify --parity``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load

from service.cli import main
from service.dataset.parity import DTYPE_BOUNDS
from service.engine.introspect import capacity_of
from tests.dataset.served_runs import make_run, tampered
from tests.dataset.test_parity import failed_layers, swap_in_next_layer
from tests.engine.checks import assert_within_bf16_gap, bf16_errors
from tests.engine.conftest import engine_settings, random_prompts, running
from tests.support.engines import serving

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
LAYERS = [0, 1, 2, 3, 4]
# 32 prompts, 1 to 100 tokens: those over 64 take two prefill chunks.
LENGTHS = [1, 2, 3, 5, 8, 11, 13, 16, 17, 20, 24, 29, 31, 32, 33, 37]
LENGTHS += [40, 45, 50, 55, 60, 63, 64, 65, 66, 70, 75, 80, 85, 90, 97, 100]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3_next(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("qwen3-next-objects")
    engine = {"dtype": "bfloat16", "layer_ids": LAYERS, "cpu_kvcache_space_gib": 0.02}
    settings = engine_settings(model_dir("qwen3-next"), str(root), engine=engine)
    async with running(settings) as extractor:
        extractor.test_root = root
        yield extractor


def stored(extractor: Any, key: str) -> Any:
    return load(Path(extractor.test_root, key).read_bytes())


async def test_serves_the_hybrid_in_bfloat16(qwen3_next: Any) -> None:
    assert qwen3_next.info.hybrid
    assert qwen3_next.dtype == "bfloat16"
    assert not qwen3_next.engine.vllm_config.cache_config.enable_prefix_caching


async def test_concurrent_prompts_and_output_tokens_within_transformers_bf16_gap(
    qwen3_next: Any,
) -> None:
    """32 prompts at once, each with 4 generated tokens stored (``include_output_tokens``):
    prompt and generated states as close to float32 as transformers' bfloat16 states."""
    prompts = random_prompts(LENGTHS, seed=71)
    params = [qwen3_next.request_params("states", include_output_tokens=True) for _ in prompts]
    runs = zip(prompts, params, strict=True)
    results = await asyncio.gather(*(qwen3_next.extract(p, q, max_tokens=4) for p, q in runs))
    sequences, states = [], []
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.output_token_ids) == 4
        # The last generated token was never an input, so it has no state.
        sequence = prompt + list(result.output_token_ids[:-1])
        tensors = stored(qwen3_next, result.key)
        assert tensors["token_ids"].tolist() == sequence
        assert tensors["hidden_states"].shape == (len(sequence), len(LAYERS), 256)
        sequences.append(sequence)
        states.append(tensors["hidden_states"])
    ours, theirs = bf16_errors(qwen3_next.settings.engine.model, sequences, states, LAYERS)
    assert_within_bf16_gap(ours, theirs, LAYERS)
    # The generated tokens' states (decode steps) alone: none far off where
    # transformers' are not (too few for medians).
    ends = torch.tensor([len(s) for s in sequences]).cumsum(0)
    generated = torch.cat([torch.arange(end - 3, end) for end in ends.tolist()])
    assert_within_bf16_gap(ours[generated], theirs[generated], LAYERS, medians=False)
    assert not qwen3_next.engine.output_processor.has_unfinished_requests()


async def test_selections_are_rows_of_the_full_states(qwen3_next: Any) -> None:
    """``tokens`` selections of the same prompts' ``all`` objects, for every codec
    offered for bfloat16 (tests/api/test_selection.py)."""
    from tests.api.test_selection import SELECTIONS, check_selected

    prompts = random_prompts([12, 47], seed=73)

    async def run(**options: Any) -> list[Any]:
        params = [
            qwen3_next.request_params("select", loss_spans=[(2, 7)], **options) for _ in prompts
        ]
        runs = zip(prompts, params, strict=True)
        return list(await asyncio.gather(*(qwen3_next.extract(p, q) for p, q in runs)))

    def body(key: str) -> bytes:
        return Path(qwen3_next.test_root, key).read_bytes()

    full = await run()
    for codec in qwen3_next.codecs:
        for selection in SELECTIONS:
            results = await run(codec=codec, tokens=selection)
            for prompt, whole, result in zip(prompts, full, results, strict=True):
                assert result.num_tokens == whole.num_tokens
                check_selected(selection, codec, body(whole.key), body(result.key), len(prompt))


async def test_a_flood_through_a_small_cache_gives_every_block_back(qwen3_next: Any) -> None:
    """Four times the tokens the cache holds, all answered; then a prompt that needs the
    whole cache is: no block was left held."""
    capacity = capacity_of((await qwen3_next.on_workers("hsx_kv_layout"))[0])["tokens"]
    longest = qwen3_next.max_model_len - 1
    assert longest <= capacity < 8 * longest  # small: the flood must wait for blocks
    lengths: list[int] = []
    while sum(lengths) <= 4 * capacity:
        lengths.append((97 * len(lengths)) % (longest - 10) + 10)
    prompts = random_prompts(lengths, seed=74)
    results = await asyncio.gather(
        *(qwen3_next.extract(p, qwen3_next.request_params("flood")) for p in prompts)
    )
    assert [r.num_tokens for r in results] == lengths
    assert not qwen3_next.engine.output_processor.has_unfinished_requests()
    whole = await qwen3_next.extract(
        random_prompts([longest], seed=75)[0], qwen3_next.request_params("flood")
    )
    assert whole.num_tokens == longest


async def verify(
    capsys: pytest.CaptureFixture[str], url: str, output: Path, model: Path
) -> tuple[int, str]:
    """``hsx dataset verify --parity`` of every row (12), on a thread: this event loop
    serves the engine the command talks to."""
    argv = ["dataset", "verify", str(output), "--endpoint", url]
    argv += ["--parity", "12", "--parity-model", str(model)]
    code = await asyncio.to_thread(main, argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


async def test_verify_parity_holds_a_run_to_the_bf16_gap_and_names_a_corrupt_layer(
    qwen3_next: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dataset run (6 token-id rows of 4-70 tokens, 6 chats) passes parity, judged by
    transformers' own bfloat16 gap from float32 (service/dataset/parity.py, the gap
    rule); the same run with one row's layer 2 holding layer 3's states fails, naming
    that row and layer."""
    model = Path(qwen3_next.settings.engine.model)
    async with serving(qwen3_next.settings, qwen3_next) as url:
        run = await asyncio.to_thread(make_run, url, qwen3_next.test_root, model, tmp_path, 512)
        code, text = await verify(capsys, url, run.output, model)
        assert code == 0, text
        report = json.loads((run.output / "parity.json").read_text())
        assert (report["rule"], report["dtype"], len(report["rows"])) == ("gap", "bfloat16", 12)
        assert [layer["layer"] for layer in report["layers"]] == LAYERS
        assert all(layer["ok"] for layer in report["layers"]), text
        # The embeddings are rounded once: as far from float32 as transformers' own.
        assert report["layers"][0]["median"] == pytest.approx(
            report["layers"][0]["reference_median"], rel=1e-6
        )
        over = sum(
            layer["relative_error"] > DTYPE_BOUNDS["bfloat16"]
            for row in report["rows"]
            for layer in row["layers"]
        )
        with capsys.disabled():  # for the record: what the per-row norm bound would say
            print(f"\nqwen3-next parity: {over} row layers over {DTYPE_BOUNDS['bfloat16']}")
            print("\n".join(line for line in text.splitlines() if "tokens:" in line))

        output = run.copy(tmp_path / "corrupt")
        row, position = 3, LAYERS.index(2)
        with tampered(run, output, row, swap_in_next_layer(position)):
            code, text = await verify(capsys, url, output, model)
    assert code == 1, text
    assert failed_layers(text) == {(row, 2)}, text
    assert "FAIL layer 2 over" in text  # and the pooled count of layer 2 fails too
