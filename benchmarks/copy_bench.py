"""Copy-out micro-benchmarks: the worker's CUDA path against plain copies of the same bytes.

On CUDA the connector gathers a request's slots on a side stream and copies them into
reused pinned buffers (``PinnedPool``). Two baselines copy the same bytes: a plain
pinned copy of an already gathered, contiguous tensor (the transfer alone), and the
naive ``cache[blocks, :, offsets].cpu()`` into fresh pageable memory. Without a CUDA
device those rows say so; the pool's own cost is measured on the CPU either way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import Row, Timer, ms

#: The start of every row this bench writes (``benchmarks.run --only`` replaces them).
ROW_PREFIXES = ("pinned pool", "64 MiB of states into a pooled buffer", "copy-out (CUDA)")

NOTES = """- **copy-out (CUDA)**: the states of one request, T tokens x 4 layers x hidden 4096
  in bfloat16 (256 tokens: 8 MiB; 2048: 64 MiB), in a hidden-state cache of 16-token
  blocks scattered over twice the blocks needed. *Ours* is the worker's own path
  (`service/engine/connector/copyout.py`'s `CudaCopy`: slot indices, the gather on a
  side stream, the copy into a pooled pinned buffer, the wait for its event, the buffer
  given back), after a warm-up that pins the pool's buffer. Baselines: a plain pinned
  copy of the same bytes already gathered and contiguous (`host.copy_(gathered,
  non_blocking=True)`, then synchronize: the transfer alone, so the ratio is what the
  gather and the bookkeeping add), and the naive `cache[blocks, :, offsets].cpu()` into
  fresh pageable memory. GB/s and the ratio are from wall time (medians of interleaved
  rounds); "GPU" is the CUDA-event time of the copy itself. Without a CUDA device the
  row says "skipped".
- **pinned pool, CPU**: `PinnedPool.take` + `give` against allocating a fresh tensor of
  the same bytes, with ordinary (unpinned) memory as on a CPU-only machine, so this is
  the pool's bookkeeping alone; then the same with 64 MiB of states copied in, where a
  fresh buffer pays its page faults on every copy and a reused one does not. Pinning
  (on CUDA) costs far more per fresh buffer than this; that is why the pool exists.
"""

MIB = 1024 * 1024
LAYERS = 4
HIDDEN = 4096
BLOCK = 16


async def run(scratch: Path, timed: Timer, quick: bool = False) -> list[Row]:
    """The pool's CPU rows; the CUDA rows, or one row saying they were skipped."""
    rounds = 3 if quick else 7
    rows = await _pool_rows(timed, rounds)
    if not torch.cuda.is_available():
        skipped = Row(
            "copy-out (CUDA): pooled pinned gather vs plain pinned copy and .cpu()",
            "skipped: no CUDA device",
            "-",
            0.0,
            "skipped (no CUDA)",
        )
        return [*rows, skipped]
    for tokens in (256,) if quick else (256, 2048):
        rows += await _cuda_rows(tokens, timed, rounds)
    return rows


async def _interleaved(
    sides: dict[str, Callable[[], object]], timed: Timer, rounds: int, repeats: int = 1
) -> dict[str, float]:
    """Median wall seconds of each side, rounds interleaved (the first is a warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(rounds + 1):
        for name, fn in sides.items():

            async def once(fn: Callable[[], object] = fn) -> object:
                return fn()

            elapsed = await timed(once, repeats)
            if round_:
                times[name] += elapsed
    return {name: statistics.median(t) for name, t in times.items()}


async def _pool_rows(timed: Timer, rounds: int) -> list[Row]:
    from service.engine.connector.pinned import PinnedPool

    def plain(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = PinnedPool(256 * MIB, allocate=plain)
    small, ops = 8 * MIB, 200
    states = torch.randn(2048, LAYERS, HIDDEN // 2)  # float32: 64 MiB

    def take_give() -> None:
        for _ in range(ops):
            pool.give(pool.take((small,), torch.uint8)[0])

    def fresh() -> None:
        for _ in range(ops):
            plain(small)

    def pooled_copy() -> None:
        buffer, view = pool.take(tuple(states.shape), states.dtype)
        view.copy_(states)
        pool.give(buffer)

    def fresh_copy() -> None:
        torch.empty_like(states).copy_(states)

    bookkeeping = await _interleaved({"ours": take_give, "fresh": fresh}, timed, rounds)
    copies = await _interleaved({"ours": pooled_copy, "fresh": fresh_copy}, timed, rounds)
    us = {k: v / ops * 1e6 for k, v in bookkeeping.items()}
    return [
        Row(
            "pinned pool take+give vs a fresh tensor, 8 MiB (CPU, unpinned)",
            f"{us['ours']:.1f} us",
            f"{us['fresh']:.1f} us",
            us["ours"] / us["fresh"],
            "info",
        ),
        Row(
            "64 MiB of states into a pooled buffer vs a fresh one (CPU, unpinned)",
            ms(copies["ours"], 2),
            ms(copies["fresh"], 2),
            copies["ours"] / copies["fresh"],
            "<= 1.0",
        ),
    ]


async def _cuda_rows(tokens: int, timed: Timer, rounds: int) -> list[Row]:
    from service.engine.connector.copyout import CudaCopy, slot_indices
    from service.engine.connector.pinned import PinnedPool
    from service.engine.jobs import PendingSave

    needed = -(-tokens // BLOCK)
    generator = torch.Generator().manual_seed(tokens)
    cache = torch.randn(2 * needed, LAYERS, BLOCK, HIDDEN, dtype=torch.bfloat16, device="cuda")
    block_ids = torch.randperm(2 * needed, generator=generator)[:needed].tolist()
    # The worker's own copy strategy on a CUDA cache, with a pool of its own.
    pool = PinnedPool(1024**3)
    copier = CudaCopy(cache, BLOCK, pool)
    blocks, offsets = slot_indices(block_ids, BLOCK, tokens)
    gathered = cache[blocks.cuda(), :, offsets.cuda()].contiguous()
    nbytes = gathered.numel() * gathered.element_size()
    pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    gpu: dict[str, list[float]] = {"ours": [], "pinned": [], "naive": []}
    save = PendingSave("r", "hsx/bench/k", tuple(range(tokens)), tuple(block_ids), {})

    def ours() -> None:
        copy = copier.start(save)
        gpu["ours"].append(copy.wait())  # the copy's own CUDA-event time
        copy.release()

    def evented(name: str, copy: Callable[[], object]) -> Callable[[], None]:
        def run_once() -> None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            gpu[name].append(start.elapsed_time(end) / 1000)

        return run_once

    plain = evented("pinned", lambda: pinned.copy_(gathered, non_blocking=True))
    naive = evented("naive", lambda: cache[blocks.cuda(), :, offsets.cuda()].cpu())
    torch.cuda.synchronize()
    wall = await _interleaved({"ours": ours, "pinned": plain, "naive": naive}, timed, rounds)
    # The pooled buffer still holds our last copy: the same bytes as the plain one.
    assert torch.equal(pool.take(tuple(gathered.shape), gathered.dtype)[1], pinned)

    def rate(name: str) -> str:
        gbps = nbytes / wall[name] / 1e9
        event = statistics.median(gpu[name][1:])  # after the warm-up round
        return f"{gbps:.1f} GB/s ({ms(wall[name], 2)}; GPU {ms(event, 2)})"

    what = f"copy-out {tokens} tokens x {LAYERS} x {HIDDEN} bf16 ({nbytes / MIB:.0f} MiB)"
    return [
        Row(
            f"{what}: pooled pinned gather vs plain pinned copy",
            rate("ours"),
            rate("pinned"),
            wall["ours"] / wall["pinned"],
            "info (gather included)",
        ),
        Row(
            f"{what}: pooled pinned gather vs naive .cpu()",
            rate("ours"),
            rate("naive"),
            wall["ours"] / wall["naive"],
            "<= 1.0",
        ),
    ]
