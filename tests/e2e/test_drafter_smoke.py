"""hsx's states train an EAGLE-3 drafter with ``speculators train``, end to end, at the
smallest size that still trains.

The drafter bench's own steps (``benchmarks/drafter_bench.py``) on 8 seed questions:
an hsx server on the demo model answers them and stores their states in one pass
(``hsx dataset run --regenerate``), ``hsx dataset export
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

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.system]

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
            data, lines = await drafter_bench.regenerate(
                url, train_q + held_q, SMOKE.max_tokens, tmp_path
            )
        save = tmp_path / "drafter"
        checkpoint, peak_mib = await drafter_bench.train(stages, demo_model, data, save, SMOKE)

    # The target answered each question.
    assert all(line["messages"][-1]["content"] for line in lines)
    assert all(line["turns"][0]["generated"] > 0 for line in lines)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3", config
    assert (checkpoint / "model.safetensors").stat().st_size > 0
    assert peak_mib > 0  # the training process reported its peak RSS
