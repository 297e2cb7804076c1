"""``hsx dataset run --estimate``: the projected size and time of a run, writing nothing.

A sample of the shard's rows is tokenised by the server (``POST /tokenize``, vLLM's
request shape; ``/extract`` cannot count tokens without running the model). The byte
projection is the object layout: states of ``num_tokens x num_layers x hidden_size``
in the served dtype, int64 token ids and, with ``loss``, a uint8 mask. The time
projection uses the server's own past throughput from ``/metrics``
(``hsx_extract_tokens_total`` over the busy seconds in ``hsx_extract_duration_seconds``),
when it has served any.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import httpx

from service.client import AsyncHsxClient, HsxError
from service.dataset.endpoints import probe_all
from service.dataset.inputs import iter_rows, open_source, shard_of
from service.dataset.options import RunOptions

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CODEC_BYTES = {"fp8": 1, "bf16": 2}


@dataclass
class Estimate:
    rows: int
    sampled: int
    mean_tokens: float
    projected_tokens: int
    projected_bytes: int
    projected_seconds: float | None

    def text(self) -> str:
        seconds = "unknown (the server has no throughput yet)"
        if self.projected_seconds is not None:
            seconds = f"{self.projected_seconds:,.0f} s"
        return (
            f"{self.rows} rows; {self.sampled} sampled, {self.mean_tokens:.1f} tokens each: "
            f"~{self.projected_tokens:,} tokens, ~{self.projected_bytes / 1e9:,.3f} GB, "
            f"~{seconds} at the server's past rate"
        )


class EstimateError(Exception):
    """The servers cannot tokenise (no ``POST /tokenize``)."""


async def estimate_async(options: RunOptions, sample: int = 64, seed: int = 0) -> Estimate:
    """Project the run's tokens, bytes and time from a sample of its rows."""
    source = open_source(options.input, options.id_column)
    rows = [
        r
        for r in iter_rows(source, options.id_column)
        if r.prompt is not None
        and (options.shard is None or shard_of(r.custom_id, options.shard[1]) == options.shard[0])
    ]
    picked = random.Random(seed).sample(rows, min(sample, len(rows)))
    clients = [AsyncHsxClient(url, options.api_key, timeout=60) for url in options.endpoint_urls()]
    try:
        info, _, _ = await probe_all(clients)
        client = next(c for c in clients if c.base_url == info.url)
        extra = options.max_tokens - 1 if options.include_output_tokens else 0
        counts = [await _count(client, info.card.id, row.prompt) + extra for row in picked]
        rate = await _tokens_per_s(client)
    finally:
        for one in clients:
            await one.aclose()
    card = info.card
    mean = sum(counts) / len(counts) if counts else 0.0
    tokens = int(mean * len(rows))
    layers = len(options.layers or card.layer_ids)
    width = CODEC_BYTES.get(options.codec or "", DTYPE_BYTES.get(card.dtype, 4))
    per_token = layers * card.hidden_size * width + 8 + (1 if options.loss != "none" else 0)
    return Estimate(
        rows=len(rows),
        sampled=len(counts),
        mean_tokens=mean,
        projected_tokens=tokens,
        projected_bytes=tokens * per_token,
        projected_seconds=tokens / rate if rate else None,
    )


async def _count(client: AsyncHsxClient, model: str, prompt: dict[str, Any] | None) -> int:
    """Tokens of a prompt: its ids, or ``POST /tokenize`` (:class:`EstimateError` if the
    server has none)."""
    assert prompt is not None
    if "token_ids" in prompt:
        return len(prompt["token_ids"])
    try:
        return (await client.tokenize(model, prompt)).count
    except HsxError as exc:
        if exc.status in (404, 405):
            raise EstimateError(
                f"{client.base_url} has no POST /tokenize; cannot estimate"
            ) from None
        raise


async def _tokens_per_s(client: AsyncHsxClient) -> float | None:
    try:
        text = await client.metrics()
    except (httpx.HTTPError, HsxError):
        return None
    tokens = _metric(text, "hsx_extract_tokens_total")
    busy = _metric(text, "hsx_extract_duration_seconds_sum")
    return tokens / busy if tokens and busy else None


def _metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None
