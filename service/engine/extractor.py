"""The engine wrapper: ``await extractor.extract(...)`` returns once the object is durable.

It owns the vLLM ``AsyncLLM``, the completion receiver and a storage handle (to remove
objects whose requests were cancelled after their states were copied out). Requests
carry server-made ids and keys; nothing from a client reaches ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from service import codecs
from service.config import Settings
from service.engine.builder import (
    ModelInfo,
    Prepared,
    bind_cpu_workers,
    engine_args,
    prepare,
    served_model_name,
    usage_context,
)
from service.engine.completion import CompletionReceiver, max_message_bytes
from service.engine.errors import (
    ERROR_TYPES,
    CompletionChannelError,
    EngineUnavailableError,
    ExtractionError,
    InvalidPromptError,
    InvalidStatesError,
)
from service.engine.front_end import VllmFrontEnd
from service.engine.hugepages import ask_for_huge_pages
from service.engine.metrics import ExtractorMetrics
from service.engine.provenance import Provenance
from service.engine.vllm_patches.catalog import check_patches
from service.engine.vllm_patches.mp_context import use_preloaded_processes
from service.engine.vllm_patches.polling import QueuePolling
from service.engine.wire import (
    Completion,
    Extraction,
    Generated,
    RequestParams,
    Sampling,
    TokenSelection,
)
from service.storage import Storage
from service.storage.keys import is_idempotent_key, new_object_key

log = logging.getLogger(__name__)

__all__ = ["Extraction", "Extractor"]


class Extractor:
    """Runs prompts through vLLM and returns the keys of their hidden-state objects."""

    def __init__(
        self,
        settings: Settings,
        engine: Any,
        receiver: CompletionReceiver,
        storage: Storage,
        metrics: ExtractorMetrics,
        info: ModelInfo,
        layer_ids: list[int],
        scratch: tempfile.TemporaryDirectory[str],
        provenance: Provenance,
    ) -> None:
        self.settings, self.engine, self.info, self.layer_ids = settings, engine, info, layer_ids
        #: What makes this server's states (every object's ``hsx.provenance.*``).
        self.provenance = provenance
        self._receiver, self._storage, self._scratch = receiver, storage, scratch
        #: Storage and writer metrics of both processes; an app registers them.
        self.metrics = metrics
        self._receiver.on_orphan = self._remove_orphan
        #: Keys with an extraction in flight here: (its lock, the calls holding or awaiting it).
        self._keys_in_flight: dict[str, tuple[asyncio.Lock, int]] = {}
        self.dtype = str(engine.vllm_config.model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(engine.vllm_config.model_config.max_model_len)
        #: The codecs this server offers (service.codecs).
        self.codecs = codecs.offered(self.dtype)
        model_config = engine.model_config
        self._front_end = VllmFrontEnd.build(
            model_config, engine.renderer, served_model_name(info.name)
        )

    @property
    def storage(self) -> Storage:
        """The storage objects are written to (reads and deletes go through it; its
        calls are counted in ``metrics``)."""
        return self._storage

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (Hugging Face interface)."""
        return self.engine.tokenizer

    async def on_workers(self, method: str) -> list[Any]:
        """Call a ``HsxWorkerExtension`` method in every worker of every engine; one
        result per worker, data-parallel engine by engine, ranks in order.

        ``AsyncLLM.collective_rpc`` asks the first engine only when there are several
        (vLLM's DP client answers utility calls with engine 0's result), so the call
        goes to each engine through the client's ``call_utility_all_async``."""
        core = self.engine.engine_core
        call_all = getattr(core, "call_utility_all_async", None)
        if call_all is None or len(getattr(core, "core_engines", ())) < 2:
            return list(await self.engine.collective_rpc(method, timeout=30))
        per_engine = await call_all("collective_rpc", method, 30, (), None)
        return [worker for workers in per_engine for worker in workers]

    @property
    def alive(self) -> bool:
        """False once the engine has died."""
        return not self.engine.errored

    @property
    def front_end(self) -> VllmFrontEnd:
        """vLLM's request front end on this engine's model config and renderer."""
        return self._front_end

    @classmethod
    async def start(
        cls,
        settings: Settings,
        prepared: Prepared | None = None,
        *,
        storage_factory: str | None = None,
    ) -> Extractor:
        """Start the engine for ``settings.engine.model``.

        ``prepared``: what ``hsx serve``'s start-up checks proved (model config, layer
        ids, the open storage); without it they are read and opened here
        (``service.engine.builder.prepare``). Either way the extractor owns the storage
        and closes it. ``storage_factory`` ("module:callable") builds the storage
        backend instead of the URL's, in the worker and (unless ``prepared`` opened
        it) here (tests inject storage faults with it; it is instrumented like any
        backend). Raises ValueError for bad layer ids, and
        ``vllm_patches.registry.PatchTargetChanged`` where vLLM changed what a
        correctness patch replaces.
        """
        from vllm.v1.engine.async_llm import AsyncLLM

        # Every patch the engine's processes will install, checked once here: they take
        # the result, and a correctness patch whose target changed raises here, not in
        # a worker (hsx serve has checked already: service.startup.check_vllm_patches).
        check_patches(settings.engine)
        if prepared is None:
            prepared = prepare(settings, storage_factory)
        bind_cpu_workers(settings.engine.tensor_parallel_size * settings.engine.data_parallel_size)
        # Read by torch in each engine process started from here (hugepages.py).
        ask_for_huge_pages(settings.engine.cpu_huge_pages)
        if settings.engine.preload_engine_processes:
            use_preloaded_processes(QueuePolling.of(settings.engine))
        info, layer_ids, metrics = prepared.info, prepared.layer_ids, prepared.metrics
        provenance = prepared.provenance
        log.info("hsx: provenance %s", provenance.fields())
        metrics.name_model(served_model_name(info.name), layer_ids)
        scratch = tempfile.TemporaryDirectory(prefix="hsx-")
        address = settings.engine.completion_address or (
            f"ipc://{Path(scratch.name) / 'completions.sock'}"
        )
        receiver = CompletionReceiver(
            address,
            bind=settings.engine.completion_bind,
            max_message_bytes=max_message_bytes(settings.limits.max_inline_bytes),
        )
        receiver.writers = settings.engine.data_parallel_size  # one writing rank per engine
        receiver.on_message = metrics.record
        receiver.on_drop = metrics.record_dropped
        receiver.start()
        args = engine_args(
            settings,
            info,
            layer_ids,
            receiver.address,
            storage_factory,
            provenance,
            completion_secret=receiver.secret,
        )
        try:
            engine = AsyncLLM.from_engine_args(args, usage_context=usage_context())
        except BaseException:
            await receiver.close()
            await prepared.storage.close()
            scratch.cleanup()
            raise
        extractor = cls(
            settings,
            engine,
            receiver,
            prepared.storage,
            metrics,
            info,
            layer_ids,
            scratch,
            provenance,
        )
        try:  # the served dtype is known only now ("auto")
            codecs.check_codec(settings.storage.codec, extractor.dtype)
        except ValueError as exc:
            await extractor.close()
            raise ValueError(f"storage.codec: {exc}") from None
        await extractor._writer_reaches_us(settings.engine.completion_timeout_s)
        return extractor

    async def _writer_reaches_us(self, timeout_s: float) -> None:
        """Wait for the writing rank's hello on the completion channel; close and raise
        CompletionChannelError if it does not come (a writer on another node that
        cannot reach ``engine.completion_address``)."""
        try:
            await asyncio.wait_for(self._receiver.writer_ready.wait(), timeout_s)
        except TimeoutError:
            address = self._receiver.address
            await self.close()
            raise CompletionChannelError(
                f"the writing rank (tensor-parallel rank 0) sent nothing to {address} in "
                f"{timeout_s:g} s"
            ) from None

    def check_codec(self, codec: str | None) -> codecs.Codec:
        """The codec a request gets (``storage.codec`` when None); ValueError naming the
        codecs offered otherwise."""
        return codecs.check_codec(codec or self.settings.storage.codec, self.dtype)

    def check_layers(self, layers: Sequence[int] | None) -> None:
        """ValueError unless ``layers`` is None or a subset of the served layer ids, in
        their order (objects keep the server's layer order)."""
        codecs.check_layers(layers, self.layer_ids)

    def request_params(
        self,
        namespace: str,
        *,
        key: str | None = None,
        codec: str | None = None,
        layers: Sequence[int] | None = None,
        include_output_tokens: bool = False,
        metadata: Mapping[str, str] | None = None,
        loss_spans: Sequence[tuple[int, int]] | None = None,
        tokens: TokenSelection = "all",
        inline_bytes: int | None = None,
    ) -> RequestParams:
        """Parameters of one prompt for :meth:`extract`, checked against this server, for
        callers outside the API (tests, benchmarks; the API builds its own once per
        request, ``service.api.extraction``). ``key`` defaults to a new random key under
        ``namespace``. Raises ValueError for a codec or layers not served."""
        chosen = self.check_codec(codec)
        self.check_layers(layers)
        return RequestParams(
            key=key or new_object_key(self.settings.storage.key_prefix, namespace),
            include_output_tokens=include_output_tokens,
            metadata=dict(metadata or {}),
            loss_spans=None if loss_spans is None else tuple(loss_spans),
            codec=chosen,
            layers=None if layers is None else tuple(layers),
            tokens=tokens,
            inline_bytes=inline_bytes,
        )

    async def extract(
        self, prompt_token_ids: Sequence[int], params: RequestParams, *, max_tokens: int = 1
    ) -> Extraction:
        """Run one prompt; return its object (under ``params.key``) once durable.

        ``params`` (``service.engine.wire.RequestParams``) were checked against this
        server by whoever built them (:meth:`request_params`, or the API once per
        request): the codec offered, the layers served. ``loss_spans`` there stores a
        ``loss_mask``; ``codec`` says how the object stores its states, ``layers`` which
        of the served layer ids it holds (None: all). Raises InvalidPromptError,
        StorageWriteError, InvalidStatesError, EngineUnavailableError (all
        ExtractionError, see ``service.engine.errors``). If the caller is cancelled, the
        engine request is aborted and no object remains (except under an idempotent
        key: see ``_remove_orphan``).
        """
        key = params.key
        async with self._one_at_a_time(key):
            waiter = self._receiver.expect(key)
            try:
                output = await self._generate(params, list(prompt_token_ids), max_tokens)
                completion = await waiter
            except BaseException:
                self._receiver.abandon(key, waiter)
                raise
        stored = tuple(self.layer_ids) if params.layers is None else params.layers
        return _extraction(completion, output, params.codec, stored)

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, key: str) -> AsyncIterator[None]:
        """Hold ``key`` while its extraction runs; a second call under it waits.

        Completions name their key only, so two extractions under one key in flight at
        once (different prompts under one ``custom_id``: the API shares a run only
        between identical requests) would take each other's completion, and one waiter
        was never answered. In turn, the second meets the first's durable object (its
        create-only write fails), which the API's idempotency check then judges."""
        lock, users = self._keys_in_flight.get(key, (asyncio.Lock(), 0))
        self._keys_in_flight[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._keys_in_flight[key]
            if users == 1:
                del self._keys_in_flight[key]
            else:
                self._keys_in_flight[key] = (lock, users - 1)

    async def generate(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> Generated:
        """Generate from ``prompt_token_ids`` and store nothing: a plain engine request
        (no hsx parameters, so the connector holds no block and its blocks go back to
        the prefix cache when it finishes). Raises what :meth:`extract` raises for the
        engine's refusals and failures."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            detokenize=False,
        )
        final = await self._run(list(prompt_token_ids), params)
        out = final.outputs[0]
        return Generated(
            token_ids=tuple(out.token_ids),
            finish_reason=str(out.finish_reason),
            cached_tokens=int(final.num_cached_tokens or 0),
        )

    @property
    def prefix_block_size(self) -> int | None:
        """Tokens per block of vLLM's prefix cache; None when prefix caching is off."""
        cache = self.engine.vllm_config.cache_config
        return int(cache.block_size) if cache.enable_prefix_caching else None

    async def _generate(self, params: RequestParams, prompt: list[int], max_tokens: int) -> Any:
        from vllm import SamplingParams

        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            detokenize=False,
            extra_args=params.to_extra_args(),
        )
        return await self._run(prompt, sampling)

    async def _run(self, prompt: list[int], sampling: Any) -> Any:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        final = None
        try:
            stream = self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt), sampling, f"hsx-{uuid.uuid4().hex}"
            )
            async for output in stream:
                final = output
        except EngineDeadError as exc:
            raise EngineUnavailableError(f"engine is dead: {exc}") from exc
        except ValueError as exc:
            raise InvalidPromptError(str(exc)) from exc
        except EngineGenerateError as exc:
            raise ExtractionError(f"engine failed the request: {exc}") from exc
        if final is None or not final.finished:
            raise ExtractionError("engine returned no final output")
        return final

    async def _remove_orphan(self, completion: Completion) -> None:
        """A cancelled request's object was written anyway: remove it.

        Except under an idempotent key: the object is complete, and what a retry of
        the prompt looks for.
        """
        stored = completion.stored
        # An inline answer was written nowhere: nothing to remove.
        if stored is not None and stored.data is None and not is_idempotent_key(completion.key):
            with contextlib.suppress(Exception):
                await self._storage.delete(completion.key)

    async def close(self) -> None:
        """Shut the engine down (the connector drains its writers), then release all."""
        self.engine.shutdown()
        _release_vllm_resources(self.engine)
        await self._receiver.close()
        await self._storage.close()
        self._scratch.cleanup()


def _release_vllm_resources(engine: Any) -> None:
    """Release what vLLM 0.32's shutdown leaves open in this process.

    It closes its client sockets but never terminates their ZMQ context (three native
    threads, eight descriptors), and keeps the exited EngineCore's process objects with
    their sentinel pipes. Both live as long as vLLM's own references, which outlast the
    engine in a process that restarts engines.
    """
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    context = getattr(resources, "ctx", None)
    if context is not None and not context.closed:
        context.destroy(linger=0)
    manager = getattr(resources, "engine_manager", None)
    for process in getattr(manager, "processes", ()):
        process.join(timeout=5)
        if process.exitcode is not None:
            process.close()


def _extraction(
    completion: Completion, output: Any, codec: str, layer_ids: tuple[int, ...]
) -> Extraction:
    """The prompt's result, or its failure raised as the matching ExtractionError."""
    failure = completion.failure
    if failure is not None:
        if failure.type == "invalid_hidden_states":  # the one failure with a reason
            raise InvalidStatesError(failure.message, failure.reason or "")
        raise ERROR_TYPES.get(failure.type, ExtractionError)(failure.message)
    assert completion.stored is not None
    return Extraction(
        **{**completion.stored.model_dump(), "layer_ids": layer_ids},
        prompt_tokens=len(output.prompt_token_ids or ()),
        output_token_ids=tuple(output.outputs[0].token_ids) if output.outputs else (),
        codec=codec,
        cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
    )
