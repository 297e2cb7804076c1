"""Score trained EAGLE-3 drafters on held-out conversations against the target's greedy
next token.

``python -m benchmarks.drafter.evaluate REFERENCE HOLDOUT_START NAME=CHECKPOINT ...``
prints one JSON object: for each drafter, the top-1 agreement at steps 0, 1 and 2 of
its test-time rollout, the positions scored at each step, and a teacher-forced
acceptance-length estimate.

Every drafter reads the same inputs: the held-out samples (index >= HOLDOUT_START) of
REFERENCE, arm (c)'s directory, i.e. the target's true hidden states from a transformers
float32 forward, as a drafter gets them from the target at inference. The arms differ
only in the states they were trained on. Samples come through speculators' own
``ArrowDataset`` and ``shift_batch``, and the drafter runs its own ``forward`` (three
TTT steps, as trained), so positions and steps line up as in speculators' validation
(``align_for_step``): the step-k draft at position j is scored against the target's
token at j + k, where the loss mask is set there. What differs from speculators'
``full_acc_k`` is the target: the argmax over the full 49152-token vocabulary from the
transformers forward (``greedy.pt``), not over the 8192-token draft vocabulary, and the
draft's token is mapped back through ``d2t``; a target token outside the draft
vocabulary is a miss, as in speculative decoding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STEPS = 3  # speculators' default --ttt-steps: the rollout the drafters are trained with


def load_drafter(checkpoint: str) -> Any:
    """A trained drafter in float32 on the CPU, with SDPA attention (flex attention, the
    default when a checkpoint is loaded, needs a compiler backend this CPU lacks)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(checkpoint)
    # transformers' config has no public setter for it; speculators' own `train
    # --draft-attn-impl` sets the same attribute (speculators/train/cli.py).
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(checkpoint, config=config)
    return model.float().eval()


def held_out(reference: Path, holdout: int) -> list[tuple[dict[str, Any], Any]]:
    """(shifted sample as a batch of one, the target's greedy tokens shifted the same way)
    for every held-out sample, read with speculators' ``ArrowDataset``."""
    import torch
    from datasets import load_from_disk
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import ArrowDataset

    total = len(load_from_disk(str(reference)))
    data = ArrowDataset(
        max_len=4096,
        datapath=str(reference),
        on_missing="raise",
        train_ratio=(holdout + 0.5) / total,  # the split index is int(total * ratio)
        split="val",
        hidden_states_dtype=torch.float32,
    )
    greedy = torch.load(reference / "greedy.pt", weights_only=True)
    samples = []
    for j in range(len(data)):
        index = j + data.start_file_idx
        shifted = shift_batch(data[j])
        batch = {k: v.unsqueeze(0) for k, v in shifted.items() if k != "lengths"}
        batch["document_ids"] = torch.zeros_like(batch["input_ids"])
        # Shifted position j holds token x_{j+1}; its target is the greedy token after it.
        samples.append((batch, greedy[index][1:]))
    return samples


def score(model: Any, samples: list[tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    """Top-1 agreement per step over the masked positions, and the mean length of the
    accepted run (leading correct steps + 1, vLLM's convention) per draft start."""
    import torch

    correct, total = [0] * STEPS, [0] * STEPS
    lengths: list[int] = []
    with torch.no_grad():
        for batch, target in samples:
            drafts = model(
                hidden_states=batch["hidden_states"],
                input_ids=batch["input_ids"],
                document_ids=batch["document_ids"],
                position_ids=batch["position_ids"],
                ttt_steps=STEPS,
            )
            mask = batch["loss_mask"][0].bool()
            size = mask.shape[0]
            hits = torch.zeros(STEPS, size, dtype=torch.bool)
            valid = torch.zeros(STEPS, size, dtype=torch.bool)
            for k, draft in enumerate(drafts):
                ids = draft[0] + model.d2t[draft[0]]  # draft vocabulary -> target's
                span = size - k
                hits[k, :span] = ids[:span] == target[k:]
                valid[k, :span] = mask[k:]
                correct[k] += int((hits[k] & valid[k]).sum())
                total[k] += int(valid[k].sum())
            run = (hits & valid).int().cumprod(dim=0).sum(dim=0) + 1
            lengths += run[valid[0]].tolist()
    return {
        "top1": [c / max(t, 1) for c, t in zip(correct, total, strict=True)],
        "positions": total,
        "acceptance_length": sum(lengths) / max(len(lengths), 1),
    }


def main() -> None:
    """CLI: REFERENCE HOLDOUT_START NAME=CHECKPOINT..."""
    reference, holdout = Path(sys.argv[1]), int(sys.argv[2])
    samples = held_out(reference, holdout)
    results = {}
    for arm in sys.argv[3:]:
        name, checkpoint = arm.split("=", 1)
        results[name] = score(load_drafter(checkpoint), samples)
    results["_samples"] = len(samples)  # type: ignore[assignment]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
