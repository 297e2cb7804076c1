"""What this machine and a model allow at most: matmul peak, FLOPs per token, disk.

A leaf library of this experiment (it imports no bench): ``limits_bench`` turns these
into rows, and any experiment that wants a model FLOP utilisation (MFU) divides its own
throughput x :func:`flops_per_token` by :func:`matmul_peak_gflops`.

* :func:`matmul_peak_gflops`: the best median GEMM rate over a few square sizes at a
  given thread count, of ``torch.mm`` and of vLLM's oneDNN GEMM (the kernel vLLM's CPU
  linear layers run): what the forward pass's matmuls could reach at most.
* :func:`flops_per_token`: a decoder's forward FLOPs per prompt token from its
  ``config.json`` (matmuls and attention; see the function for what is left out).
* :func:`durable_write_mb_s`: large writes made durable (file and directory fsync),
  the ceiling for a writer that fsyncs every object.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

#: Square sizes large enough that the mm is compute-bound (a 1024 float32 operand is
#: 4 MiB, past L2), small enough to time in well under a second each on two cores.
MATMUL_SIZES = (1024, 2048, 3072)
MB = 1_000_000  # durable_write_mb_s reports decimal megabytes, as disks are rated


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``call()`` over ``repeats`` calls (after one untimed call, which
    pays for page faults and thread start-up)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _onednn_gemm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object] | None:
    """vLLM's oneDNN GEMM of ``a`` by ``b``, its weight prepacked as vLLM's CPU linear
    layers prepack theirs (``dispatch_cpu_unquantized_gemm``:
    ``create_onednn_mm(weight.t(), 32)``), or None where vLLM or its oneDNN is absent."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    handler = ops.create_onednn_mm(b.t().contiguous().t(), 32)
    return functools.partial(ops.onednn_mm, handler, a, None)


def matmul_peak_gflops(
    dtype: torch.dtype,
    threads: int,
    *,
    sizes: Sequence[int] = MATMUL_SIZES,
    repeats: int = 5,
) -> float:
    """Measured GEMM peak in GFLOP/s of ``dtype`` on ``threads`` threads: the better of
    ``torch.mm`` and vLLM's oneDNN GEMM, which vLLM's CPU build runs its linear layers
    on. On the AMD host of 2026-11-28 oneDNN reached about twice ``torch.mm``'s float32
    rate (435 against 202 GFLOP/s on two threads), so a ``torch.mm`` peak put the
    engines' model FLOP utilisation above 100%.

    For each square size n, ``2 n^3`` FLOPs over the median time of ``repeats`` calls;
    the best size and kernel win (smaller sizes lose to overheads, larger ones to cache
    misses, which one depends on the machine). Torch's thread count is restored
    afterwards. Run it while nothing else computes: the engine's threads would share
    the cores.
    """
    best = 0.0
    with torch_threads(threads), torch.inference_mode():
        for n in sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            out = torch.empty(n, n, dtype=dtype)
            kernels = [functools.partial(torch.mm, a, b, out=out), _onednn_gemm(a, b)]
            seconds = min(_median_seconds(k, repeats) for k in kernels if k is not None)
            best = max(best, 2 * n**3 / seconds / 1e9)
    return best


def _config(model_dir: Path) -> dict[str, int]:
    """The shape fields of a Llama-like ``config.json`` that the FLOP count needs."""
    raw = json.loads((model_dir / "config.json").read_text())
    raw = raw.get("text_config", raw)  # multimodal configs nest the decoder's
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    return {
        "hidden": hidden,
        "intermediate": int(raw["intermediate_size"]),
        "layers": int(raw["num_hidden_layers"]),
        "heads": heads,
        "kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "vocab": int(raw["vocab_size"]),
    }


def matmul_parameters(model_dir: Path) -> int:
    """Weights that multiply every prompt token: per decoder layer the Q, K, V and O
    projections and the gated MLP's gate, up and down projections (Llama's shape).
    Embedding (a lookup) and the LM head (see :func:`lm_head_flops`) are not counted."""
    c = _config(model_dir)
    q_and_o = 2 * c["hidden"] * c["heads"] * c["head_dim"]
    k_and_v = 2 * c["hidden"] * c["kv_heads"] * c["head_dim"]
    mlp = 3 * c["hidden"] * c["intermediate"]
    return c["layers"] * (q_and_o + k_and_v + mlp)


def flops_per_token(model_dir: Path, context: int) -> float:
    """Forward FLOPs per prompt token of the decoder in ``model_dir`` (its config.json),
    when a token attends to ``context`` tokens on average.

    Counted: ``2 x`` :func:`matmul_parameters` (one multiply and one add per weight),
    plus attention's ``Q K^T`` and ``A V``, ``2 x heads x head_dim x context`` each per
    layer. For a prefill of causal prompts of n tokens the mean context is about
    ``(n + 1) / 2``. Not counted: norms, rotary embedding, softmax, SiLU and residual
    adds (elementwise, under 1% here), the embedding lookup (no FLOPs), and the LM
    head: the extraction engine generates one output token, so the vocabulary
    projection runs once per prompt, not per token (:func:`lm_head_flops`; under 0.5%
    of a 256-token prompt of SmolLM2-135M), and the transformers pipeline runs the base
    model without it. Counting it per token would credit the engine with work it does
    not do.
    """
    c = _config(model_dir)
    attention = 2 * 2 * c["heads"] * c["head_dim"] * context * c["layers"]
    return float(2 * matmul_parameters(model_dir) + attention)


def lm_head_flops(model_dir: Path) -> float:
    """FLOPs of one vocabulary projection (``2 x hidden x vocab``): once per prompt in
    an engine that generates one token."""
    c = _config(model_dir)
    return float(2 * c["hidden"] * c["vocab"])


def _fsync_directory(directory: Path) -> None:
    """Make the directory entries (a new file's name) durable, as hsx's writer does."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_write_seconds(path: Path, size_mib: int, chunk: bytes) -> float:
    """Seconds to write ``size_mib`` MiB to a new ``path`` in ``chunk``-sized writes,
    fsync it and its directory."""
    chunks = size_mib * (1 << 20) // len(chunk)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(chunks):
            f.write(chunk)
        os.fsync(f.fileno())
    _fsync_directory(path.parent)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def durable_write_mb_s(directory: Path, size_mib: int, *, repeats: int = 3) -> float:
    """Durable-write bandwidth of ``directory``'s file system, MB/s (10^6 bytes).

    Each of ``repeats`` rounds writes one new file of ``size_mib`` MiB (random bytes,
    so compression cannot help, in 8 MiB writes), fsyncs it and the directory, and
    deletes it; the median counts. Large files measure the disk's streaming rate: the
    best a writer that makes each object durable can do, before per-file costs.
    """
    directory.mkdir(parents=True, exist_ok=True)
    chunk_mib = min(8, size_mib)
    chunk = os.urandom(chunk_mib << 20)
    size_mib = size_mib // chunk_mib * chunk_mib
    times = [
        _durable_write_seconds(directory / f"hsx-durable-{i}.bin", size_mib, chunk)
        for i in range(repeats)
    ]
    return size_mib * (1 << 20) / statistics.median(times) / MB
