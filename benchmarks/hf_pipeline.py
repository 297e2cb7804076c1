"""The transformers baseline of the engine bench: what a user would write without hsx.

A batched forward pass with ``output_hidden_states`` under ``torch.inference_mode``,
prompts batched by length (``tokens_per_batch`` tokens a batch), the requested layers
stacked into hsx's ``[tokens, layers, hidden]`` layout, and one safetensors file per
prompt written by a thread pool while the next batch computes: to local disk with an
fsync per file, or to S3 with ``put_object``. The base model (``AutoModel``) runs, so
no vocabulary projection is computed for every position (vLLM computes one row).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    """Where the baseline puts one prompt's file."""

    def write(self, name: str, data: bytes) -> None: ...

    def clear(self) -> None:
        """Remove every file written so far."""


class LocalSink:
    """One file per prompt under ``root``, fsync'd before the prompt counts as done."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, data: bytes) -> None:
        with open(self.root / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def clear(self) -> None:
        for path in self.root.iterdir():
            path.unlink()


class S3Sink:
    """One object per prompt in ``bucket`` (boto3's defaults, one shared client)."""

    def __init__(self, endpoint: str, bucket: str, threads: int) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.keys: list[str] = []  # list.append is atomic: safe from the writer threads
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            config=Config(max_pool_connections=2 * threads),
        )

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"hf/{name}", Body=data)
        self.keys.append(f"hf/{name}")

    def clear(self) -> None:
        for start in range(0, len(self.keys), 1000):  # S3 deletes up to 1000 keys a call
            batch = self.keys[start : start + 1000]
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": key} for key in batch]}
            )
        self.keys.clear()


class HfPipeline:
    """Hidden states of ``layer_ids`` for many prompts, one file each."""

    def __init__(
        self,
        model: Path,
        layer_ids: Sequence[int],
        *,
        tokens_per_batch: int = 4096,
        writer_threads: int = 4,
    ) -> None:
        import torch
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
        self.layer_ids = list(layer_ids)
        self.tokens_per_batch = tokens_per_batch
        self.writer_threads = writer_threads

    def run(self, prompts: Sequence[Sequence[int]], sink: Sink) -> None:
        """Compute and write every prompt; return once every file is written."""
        with ThreadPoolExecutor(self.writer_threads, "hf-writer") as pool:
            pending: list[Future[None]] = []
            for batch in self._batches(prompts):
                for ids, states in zip(batch, self._forward(batch), strict=True):
                    pending.append(pool.submit(_write, sink, ids, states))
            for future in pending:
                future.result()

    def _batches(self, prompts: Sequence[Sequence[int]]) -> Iterator[list[Sequence[int]]]:
        """Prompts sorted by length, cut into batches of about ``tokens_per_batch``."""
        batch: list[Sequence[int]] = []
        for prompt in sorted(prompts, key=len):
            if batch and len(prompt) * (len(batch) + 1) > self.tokens_per_batch:
                yield batch
                batch = []
            batch.append(prompt)
        if batch:
            yield batch

    def _forward(self, batch: list[Sequence[int]]) -> list[Any]:
        """``[tokens, layers, hidden]`` per prompt (right padding, sliced off)."""
        import torch

        longest = max(len(p) for p in batch)
        ids = torch.full((len(batch), longest), 2, dtype=torch.long)  # 2 = <pad>
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            hidden = out.hidden_states
            return [
                torch.stack([hidden[i][row, : len(p)] for i in self.layer_ids], dim=1)
                for row, p in enumerate(batch)
            ]


def _write(sink: Sink, ids: Sequence[int], states: Any) -> None:
    import torch
    from safetensors.torch import save

    tensors = {"hidden_states": states, "token_ids": torch.tensor(list(ids), dtype=torch.long)}
    sink.write(f"{uuid.uuid4().hex}.safetensors", save(tensors))
