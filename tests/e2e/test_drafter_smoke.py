"""hsx's states train an EAGLE-3 drafter with ``speculators train``, end to end, at the
smallest size that still trains.

The drafter bench's own steps (``benchmarks/drafter_bench.py``) on 8 seed questions:
an hsx server on the demo model answers them through ``/v1/chat/completions``,
``hsx dataset run --loss assistant`` stores their states, ``hsx dataset export
--format speculators`` writes speculators' data directory, and ``speculators train``
(through ``benchmarks.drafter.train_cpu``'s CPU patches) trains one epoch of one arm on
it. The bench's quick run of all four arms, the scoring and vLLM's acceptance length
check the rows' form in ``make bench-smoke`` (``tests/e2e/test_bench_smoke.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import drafter_bench
from benchmarks.common import Preforked

pytestmark = [pytest.mark.engine, pytest.mark.slow]

#: One held-out question (every eighth), so speculators has a validation split.
SMOKE = drafter_bench.Size(questions=8, max_tokens=16, epochs=1)


@pytest.mark.timeout(900)
async def test_hsx_states_train_a_drafter(tmp_path: Path, demo_model: Path) -> None:
    train_q, held_q = drafter_bench.split(drafter_bench.load_questions(SMOKE.questions))
    stages_log = tmp_path / "stages.log"
    env = drafter_bench.child_env()
    # The torch stages' process imports while the hsx server starts and answers.
    async with Preforked.start(drafter_bench.TORCH_STAGES, stages_log, env) as stages:
        async with drafter_bench.hsx_server(demo_model, tmp_path, eager=True) as url:
            conversations = await drafter_bench.respond(
                url, demo_model.name, train_q + held_q, SMOKE.max_tokens
            )
            data = await drafter_bench.extract_and_export(url, conversations, "raw", tmp_path)
        save = tmp_path / "drafter"
        checkpoint, peak_mib = await drafter_bench.train(stages, demo_model, data, save, SMOKE)

    assert all(turn[1]["content"] for turn in conversations)  # the target answered each
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3", config
    assert (checkpoint / "model.safetensors").stat().st_size > 0
    assert peak_mib > 0  # the training process reported its peak RSS
