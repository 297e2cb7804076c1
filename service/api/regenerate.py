"""``regenerate`` on ``/extract``: on-policy data in one pass over the target.

For each ``messages`` prompt, every assistant turn is replaced by the target's own
answer, turn by turn (``service.api.turns`` keeps the token ids as generated). Each
turn is a plain engine request (``ExtractorLike.generate``: nothing stored) whose prompt
is the ids so far plus the template's tokens up to the next answer, so vLLM's prefix
cache holds every block the earlier turns computed, generated tokens' states included
(hsx's hidden-state cache group is one of the KV cache's groups). One last request
stores the whole sequence (``max_tokens`` 1): it hits the cache for all but the last
partial block, so the states of generated tokens are those their decode step wrote.
Where the cache lost a turn's blocks (evicted between turns), vLLM computes them again
from the same ids: the object is right, and the row counts them in
``recomputed_tokens``.

Under a ``custom_id`` a row is generated at most once: what identifies it is its
input's hash and the sampling settings (``hsx.regenerate`` in the object, beside
``hsx.request``), and a retry gets the stored object and its conversation back.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from service.api.errors import ApiError, limit_error
from service.api.idempotency import REQUEST_KEY, Found, _Check, request_options
from service.api.job import ExtractOptions, Job
from service.api.pool import in_pool
from service.api.prompts import check_prompt_sizes, check_request_limits
from service.api.schemas import REGENERATE_KEY, ExtractRequest, PromptObject, Regenerate
from service.api.state import ApiState, ensure_serving
from service.api.turns import TurnBuilder, TurnError, check_renderable
from service.engine.errors import InvalidPromptError, StorageWriteError
from service.engine.wire import Extraction, Sampling
from service.storage.keys import idempotent_key, new_object_key

log = logging.getLogger(__name__)


class Regenerated(Extraction):
    """A regenerated prompt's object and its conversation (``StoredObject.regenerated``)."""

    regenerated: dict[str, Any]
    found: bool = False


@dataclass(frozen=True)
class RegenerateJob(Job):
    """A :class:`Job` whose prompts are conversations to regenerate."""

    conversations: Sequence[list[dict[str, Any]]] = ()
    settings: Regenerate = field(default_factory=Regenerate)


# ------------------------------------------------------------------ checking


def check_request(body: ExtractRequest, state: ApiState) -> None:
    """Refuse (422 naming the field) what ``regenerate`` cannot take: prompts other than
    ``messages``, options that ask for other tokens or another mask, an inline answer."""
    settings = body.regenerate
    assert settings is not None
    for index, prompt in enumerate(body.prompts):
        if not isinstance(prompt, PromptObject) or prompt.messages is None:
            field_name = f"prompts[{index}]"
            raise ApiError(
                422,
                "invalid_request",
                f"{field_name}: regenerate needs a messages prompt",
                field=field_name,
                index=index,
            )
    refusals = {
        "include_output_tokens": body.include_output_tokens
        and "a regenerated object holds every generated token already",
        "max_tokens": body.max_tokens != 1
        and "with regenerate, each turn's budget is regenerate.max_tokens",
        "return": body.return_ == "inline" and "a regenerated object is stored, never inline",
        "loss": body.loss not in ("none", "assistant")
        and "with regenerate, 'assistant' masks the generated answers; 'none' stores no mask",
    }
    for name, reason in refusals.items():
        if reason:
            raise ApiError(422, "invalid_request", f"{name}: {reason}", field=name)
    if settings.temperature > 0 and _on_cpu():
        # vLLM 0.32's CPU runner cannot seed a request: its seeded sampling is not
        # reproducible there, and a seeded request whose prompt spans prefill chunks
        # kills the engine ("CPU Generator does not use offset").
        raise ApiError(
            422,
            "invalid_request",
            "regenerate.temperature: sampled regeneration is seeded per row, which vLLM's "
            "CPU sampler cannot do (not reproducible, and it stops the engine on a long "
            "prompt); use greedy (temperature 0) here, or a GPU server",
            field="regenerate.temperature",
        )
    limit = state.settings.limits.max_tokens
    if settings.max_tokens is not None and settings.max_tokens > limit:
        raise limit_error("regenerate.max_tokens", f"{settings.max_tokens}; at most {limit}")


async def build_job(
    state: ApiState, body: ExtractRequest, namespace: str, deadline: float
) -> RegenerateJob:
    """The request checked (ApiError otherwise): limits, options, and each conversation
    renderable with a user turn and room for an answer, before anything is generated."""
    check_request_limits(len(body.prompts), 1, state.settings.limits)
    ensure_serving(state)
    check_request(body, state)
    extractor = state.extractor
    check_prompt_sizes(
        body.prompts,
        1,
        token_bytes=state.max_token_bytes,
        max_model_len=extractor.max_model_len,
        limits=state.settings.limits,
    )
    options = ExtractOptions.checked(
        state,
        max_tokens=1,
        include_output_tokens=False,
        metadata=body.metadata,
        loss=body.loss,
        codec=body.codec,
        layers=body.layers,
        tokens=body.tokens,
        ttl_s=body.ttl_s,
    )
    conversations = [
        [m.model_dump() for m in prompt.messages or ()]
        for prompt in body.prompts
        if isinstance(prompt, PromptObject)
    ]
    check = partial(_check_conversations, extractor.tokenizer, conversations, extractor)
    await in_pool(state, check, deadline)
    custom_ids = [getattr(prompt, "custom_id", None) for prompt in body.prompts]
    settings = body.regenerate or Regenerate()
    return RegenerateJob(
        namespace,
        [[] for _ in conversations],
        [None] * len(conversations),
        custom_ids,
        options,
        deadline,
        conversations=conversations,
        # The budget resolved, so what a row records is what it was made with.
        settings=settings.model_copy(
            update={"max_tokens": settings.max_tokens or state.settings.limits.max_tokens}
        ),
    )


def _check_conversations(
    tokenizer: Any, conversations: Sequence[list[dict[str, Any]]], extractor: Any
) -> None:
    for index, messages in enumerate(conversations):
        field_name = f"prompts[{index}].messages"
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(
                422,
                "invalid_request",
                f"{field_name}: the model has no chat template",
                field=field_name,
                index=index,
            )
        try:
            check_renderable(tokenizer, messages, extractor.max_model_len)
        except TurnError as exc:
            raise ApiError(
                422, "invalid_request", f"{field_name}: {exc}", field=field_name, index=index
            ) from None


def _on_cpu() -> bool:
    from service.engine.builder import on_cpu

    return on_cpu()


# ------------------------------------------------------------------ running


def input_digest(messages: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 of the conversation as sent: what a stored row was made from."""
    text = json.dumps(list(messages), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def row_seed(seed: int, custom_id: str | None, digest: str) -> int:
    """The row's seed: the run's ``seed`` with the row's identity (its custom_id, else
    its input's hash), the same however rows are batched or resumed."""
    identity = custom_id if custom_id is not None else digest
    text = f"{seed}:{identity}".encode("utf-8", "surrogatepass")
    return int(hashlib.sha256(text).hexdigest()[:15], 16)


async def run_prompt(state: ApiState, job: RegenerateJob, index: int) -> Extraction:
    """Prompt ``index`` regenerated and stored (or found under its custom_id)."""
    messages, custom_id = job.conversations[index], job.custom_ids[index]
    digest = input_digest(messages)
    seed = row_seed(job.settings.seed, custom_id, digest)
    identity = {"input": digest, "settings": job.settings.model_dump(), "seed": seed}
    options = job.options
    metadata = dict(options.metadata)
    if custom_id is None:
        key = new_object_key(state.settings.storage.key_prefix, job.namespace)
        return await _make(state, job, index, key, metadata, identity)
    extractor = state.extractor
    key = idempotent_key(
        state.settings.storage.key_prefix,
        job.namespace,
        custom_id=custom_id,
        model=extractor.info.name,
        layer_ids=extractor.layer_ids,
        dtype=extractor.dtype,
    )
    asked = request_options(state, options)
    check = _RegenerateCheck(state.storage, key, custom_id, [], asked, dict(metadata), identity)
    recorded = json.dumps(asked, sort_keys=True, separators=(",", ":"))
    metadata[REQUEST_KEY] = recorded

    async def start() -> Extraction:
        found = await check.lookup()
        if found is not None:
            return found
        try:
            return await _make(state, job, index, key, metadata, identity)
        except StorageWriteError:
            found = await check.lookup()  # another writer stored it first (create-only)
            if found is None:
                raise
            return found

    flight = f"{key}#regenerate#{hashlib.sha256(json.dumps(identity).encode()).hexdigest()}"
    result, shared = await state.flights.run(flight, start)
    if shared and isinstance(result, Regenerated):
        return result.model_copy(update={"found": True})
    return result


async def _make(
    state: ApiState,
    job: RegenerateJob,
    index: int,
    key: str,
    metadata: dict[str, str],
    identity: dict[str, Any],
) -> Regenerated:
    """Generate every turn, then store the conversation's states in one request."""
    builder = await _generate(state, job, index, identity["seed"])
    info = _conversation(builder, identity)
    spans = tuple(builder.spans) if job.options.loss == "assistant" else None
    params = job.options.params(
        key, spans, {**metadata, REGENERATE_KEY: json.dumps(info, ensure_ascii=False)}
    )
    stored = await state.extractor.extract(builder.ids, params, max_tokens=1)
    generated = sum(turn.generated for turn in builder.turns)
    # Tokens the target ran forward for this row: each turn's uncached prompt tokens and
    # its decode steps (every generated token but the last is fed back), then the
    # final request's uncached tokens.
    forward = sum(
        (turn.start - turn.cached_tokens) + max(0, turn.generated - 1) for turn in builder.turns
    ) + (len(builder.ids) - stored.cached_tokens)
    answer = {
        **info,
        "token_ids": list(builder.ids),
        "generated_tokens": generated,
        "final_cached_tokens": stored.cached_tokens,
        "forward_tokens": forward,
        "recomputed_tokens": _recomputed(state, builder, stored.cached_tokens),
    }
    return Regenerated(**stored.model_dump(), regenerated=answer)


async def _generate(state: ApiState, job: RegenerateJob, index: int, seed: int) -> TurnBuilder:
    """Every assistant turn of prompt ``index``, generated in order."""
    extractor, settings = state.extractor, job.settings
    start = partial(
        TurnBuilder.start, extractor.tokenizer, job.conversations[index], extractor.max_model_len
    )
    builder: TurnBuilder = await _rendered(state, job, index, start)
    while not builder.done:
        prompt = await _rendered(state, job, index, builder.prompt)
        wanted = settings.max_tokens or state.settings.limits.max_tokens
        room = await _rendered(state, job, index, partial(builder.room, wanted))
        sampling = Sampling(
            max_tokens=room,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=(seed + len(builder.turns)) % (1 << 63),
        )
        out = await extractor.generate(prompt, sampling)
        accept = partial(builder.accept, out.token_ids, out.finish_reason, out.cached_tokens)
        await _rendered(state, job, index, accept)
    return builder


async def _rendered(state: ApiState, job: RegenerateJob, index: int, call: Any) -> Any:
    """A render of the builder's on the tokenizer pool; a TurnError fails the prompt."""
    try:
        return await in_pool(state, call, job.deadline)
    except TurnError as exc:
        raise InvalidPromptError(f"prompts[{index}].messages: {exc}") from None


def _conversation(builder: TurnBuilder, identity: dict[str, Any]) -> dict[str, Any]:
    """What the object records of its conversation (``hsx.regenerate``)."""
    return {
        **identity,
        "messages": builder.messages,
        "turns": [
            {
                "message": t.message,
                "start": t.start,
                "end": t.end,
                "generated": t.generated,
                "finish_reason": t.finish_reason,
                "cached_tokens": t.cached_tokens,
            }
            for t in builder.turns
        ],
    }


def _recomputed(state: ApiState, builder: TurnBuilder, final_cached: int) -> int:
    """Tokens the prefix cache should have held but did not (blocks evicted between
    turns, computed again): each request's shortfall against the full blocks the
    requests before it left."""
    block = state.extractor.prefix_block_size
    if not block:
        return 0
    shortfall, computed = 0, 0
    requests = [(t.start, t.cached_tokens, t.start + t.generated - 1) for t in builder.turns]
    requests.append((len(builder.ids), final_cached, len(builder.ids)))
    for prompt, cached, kept in requests:
        expected = min(computed, prompt - 1) // block * block
        shortfall += max(0, expected - cached)
        computed = max(computed, kept)
    return shortfall


class _RegenerateCheck(_Check):
    """The idempotency check of a regenerated row: the stored token ids were generated,
    so the row is the same when its input and sampling are (``hsx.regenerate``)."""

    def __init__(self, *args: Any) -> None:
        *base, self.identity = args
        super().__init__(*base)

    async def lookup(self) -> Found | None:
        found = await super().lookup()
        if found is None:
            return None
        recorded = self.recorded
        answer = {
            **recorded,
            "generated_tokens": sum(t.get("generated", 0) for t in recorded.get("turns", ())),
            "forward_tokens": 0,  # found: the engine did not run for it
            "recomputed_tokens": 0,
        }
        return Regenerated(  # type: ignore[return-value]
            **{**found.model_dump(exclude={"found"}), "output_token_ids": ()},
            regenerated=answer,
            found=True,
        )

    def _differences(
        self, stored: list[int], options: Mapping[str, Any], metadata: Mapping[str, str]
    ) -> list[str]:
        self.token_ids = stored  # generated: the identity below decides
        callers = {k: v for k, v in metadata.items() if k != REGENERATE_KEY}
        found = super()._differences(stored, options, callers)
        try:
            record = json.loads(metadata.get(REGENERATE_KEY, "null"))
        except ValueError:
            record = None
        if not isinstance(record, dict):
            return [*found, "no regeneration (a plain extraction is stored)"]
        for name in ("input", "settings", "seed"):
            if record.get(name) != self.identity[name]:
                found.append(f"other {'messages' if name == 'input' else name}")
        self.recorded = {**record, "token_ids": stored}
        return found
