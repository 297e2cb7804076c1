"""Arms (c) and (d) of the drafter bench, from one transformers forward per sample.

``python -m benchmarks.drafter.reference MODEL SOURCE REFERENCE CONTROL HOLDOUT_START
[FP8_SOURCE]``
reads a speculators data directory that ``hsx dataset export`` wrote (SOURCE, arm (a))
and writes two more in the same layout, for the same samples:

- REFERENCE, arm (c): each sample's hidden states recomputed by transformers in float32
  (``output_hidden_states[i]`` for ids below the layer count, the final decoder layer's
  output before the norm for the last id, as vLLM's ``extract_hidden_states`` defines
  them), plus ``greedy.pt``: for each held-out sample (index >= HOLDOUT_START) the
  target's greedy next token at every position (argmax of the full-vocabulary logits).
- CONTROL, arm (d): the same files with every hidden state zero, as vLLM #46301
  returned them for hybrid models.

The token ids, loss masks and ``token_freq.pt`` are SOURCE's (copied), so the four arms
differ in their hidden states only. Runs in a process of its own: the 135M model in
float32 is half a gigabyte that the bench gets back when it exits. Prints a JSON line
with the largest relative error of SOURCE's states (and of FP8_SOURCE's, arm (b), when
given) against the reference, per layer.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

#: Files of the dataset directory that are not per-sample states (speculators caches
#: its vocabulary mapping as d2t-/t2d-*.npy next to them: never copied, each arm
#: derives its own from the same token_freq.pt).
SKIP = ("hidden_states", "d2t-", "t2d-")


def copy_layout(source: Path, dest: Path) -> None:
    """Copy SOURCE's dataset files (ids, masks, token_freq.pt) into a new DEST."""
    (dest / "hidden_states").mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.startswith(SKIP):
            shutil.copy2(item, dest / item.name)


def layer_ids_of(num_layers: int, count: int) -> list[int]:
    """hsx's default EAGLE-3 layer ids ``[2, L//2, L-3, L]`` (what the bench serves)."""
    ids = sorted({min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)})
    ids.append(num_layers)
    assert len(ids) == count, (ids, count)
    return ids


class Forward:
    """transformers float32 forward that returns hsx's layout for given layer ids."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_grad_enabled(False)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.num_layers = int(self.model.config.num_hidden_layers)
        self._final: list[Any] = []
        # The last id is the decoder stack's output before the final norm: the norm's input.
        self.model.model.norm.register_forward_pre_hook(
            lambda _module, args: self._final.append(args[0])
        )

    def __call__(self, token_ids: Any, layers: list[int], logits: bool) -> tuple[Any, Any]:
        """States [T, len(layers), H] and (when ``logits``) the greedy next tokens [T]."""
        import torch

        self._final.clear()
        ids = token_ids.unsqueeze(0)
        if logits:
            out = self.model(input_ids=ids, output_hidden_states=True)
            greedy = out.logits[0].argmax(-1)
            hidden = out.hidden_states
        else:  # the base model alone: no 49152-wide lm_head for rows that need none
            hidden = self.model.model(input_ids=ids, output_hidden_states=True).hidden_states
            greedy = None
        states = [self._final[0][0] if i == self.num_layers else hidden[i][0] for i in layers]
        return torch.stack(states, dim=1).contiguous(), greedy


def relative_error(ours: Any, reference: Any) -> float:
    """Norm of the difference over the norm of the reference."""
    return float((ours - reference).norm() / reference.norm().clamp_min(1e-30))


def build(
    model_dir: str, source: Path, reference: Path, control: Path, holdout: int, fp8: Path | None
) -> dict[str, Any]:
    """Write arms (c) and (d) from SOURCE's samples; the sample count and the worst
    relative error per layer of SOURCE's (and FP8's, when given) states against the
    reference."""
    import torch
    from safetensors.torch import load_file, save_file

    forward = Forward(model_dir)
    copy_layout(source, reference)
    copy_layout(source, control)
    compared = {"raw": source, **({"fp8": fp8} if fp8 else {})}
    files = sorted(
        (source / "hidden_states").glob("hs_*.safetensors"),
        key=lambda p: int(p.stem.removeprefix("hs_")),
    )
    worst: dict[str, list[float]] = {}
    greedy: dict[int, Any] = {}
    for path in files:
        index = int(path.stem.removeprefix("hs_"))
        ids = load_file(str(path))["token_ids"]
        count = load_file(str(path))["hidden_states"].shape[1]
        layers = layer_ids_of(forward.num_layers, count)
        states, next_tokens = forward(ids, layers, logits=index >= holdout)
        if next_tokens is not None:
            greedy[index] = next_tokens.clone()
        for name, directory in compared.items():
            sample = load_file(str(directory / "hidden_states" / path.name))
            assert torch.equal(sample["token_ids"], ids), (name, path.name)
            ours = sample["hidden_states"].float()
            errors = [relative_error(ours[:, j], states[:, j]) for j in range(len(layers))]
            worst[name] = [max(a, b) for a, b in zip(worst.get(name, errors), errors, strict=True)]
        target = Path("hidden_states") / path.name
        save_file({"hidden_states": states, "token_ids": ids}, str(reference / target))
        zeros = torch.zeros_like(states)
        save_file({"hidden_states": zeros, "token_ids": ids}, str(control / target))
    torch.save(greedy, reference / "greedy.pt")
    return {"samples": len(files), "layers": layers, "worst_relative_error": worst}


def main() -> None:
    """CLI: MODEL SOURCE REFERENCE CONTROL HOLDOUT_START [FP8_SOURCE]."""
    model_dir, source, reference, control, holdout = sys.argv[1:6]
    fp8 = Path(sys.argv[6]) if len(sys.argv) > 6 else None
    result = build(model_dir, Path(source), Path(reference), Path(control), int(holdout), fp8)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
