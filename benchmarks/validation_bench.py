"""What checking the states before each write costs, against serialising them."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import Row, Timer

#: The start of every row this bench writes (``benchmarks.run --only`` replaces them).
ROW_PREFIXES = ("state validation vs serialisation",)

NOTES = """- **state validation vs serialisation**: `check_states` (every value finite, no layer
  all zeros: a max and a min per layer) on a float32 [8192, 4, 1024] tensor (128 MiB:
  an 8k-token prompt, 4 layers) against `safetensors` serialisation of the same tensor,
  which every write does anyway. Both run on the writer's thread, off the forward pass.
"""


async def run(scratch: Path, timer: Timer, quick: bool = False) -> list[Row]:
    """One row: validation time, serialisation time, their ratio (``quick`` changes
    nothing: it is short)."""
    import torch

    from service.engine.objects import object_metadata, serialize_parts
    from service.engine.validation import check_states

    states = torch.randn(8192, 4, 1024)
    token_ids = torch.arange(8192)
    metadata = object_metadata("bench", [1, 2, 3, 4], "float32")
    mib = states.numel() * states.element_size() / 2**20

    async def ours() -> object:
        check_states(states)
        return None

    async def baseline() -> object:
        return b"".join(serialize_parts("raw", states, token_ids, metadata))

    ours_t, base_t = [], []
    for _ in range(5):  # interleaved, so drift hits both sides
        ours_t += await timer(ours, 1)
        base_t += await timer(baseline, 1)
    check, save = min(ours_t), min(base_t)
    return [
        Row(
            f"state validation vs serialisation ({mib:.0f} MiB float32)",
            f"{check * 1000:.1f} ms ({check * 1000 / mib:.2f} ms/MiB)",
            f"{save * 1000:.1f} ms",
            check / save,
            "<= 0.5",
        )
    ]
