"""The engine wrapper: ``await extractor.extract(...)`` returns once the object is durable.

It owns the vLLM ``AsyncLLM``, the completion receiver and a storage handle (to remove
objects whose requests were cancelled after their states were copied out). Requests
carry server-made ids and keys; nothing from a client reaches ``kv_transfer_params``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service import codecs
from service.config import Settings
from service.engine.builder import ModelInfo, engine_args, read_model_info, resolve_layer_ids
from service.engine.completion import Completion, CompletionReceiver
from service.engine.connector import REQUEST_ARG
from service.storage import Storage
from service.storage import storage_factory as open_storage_with
from service.storage.keys import new_object_key

log = logging.getLogger(__name__)


class ExtractionError(Exception):
    """An extraction did not produce an object."""


class StorageWriteError(ExtractionError):
    """The hidden states were computed but could not be written."""


class EngineUnavailableError(ExtractionError):
    """The engine is dead or shutting down."""


class InvalidPromptError(ExtractionError, ValueError):
    """The engine refused the prompt (too long, bad token ids)."""


@dataclass(frozen=True)
class Extraction:
    """One durable object and what it holds."""

    key: str
    uri: str
    size: int
    sha256: str
    num_tokens: int
    shape: tuple[int, ...]
    prompt_tokens: int
    output_token_ids: tuple[int, ...]
    copy_s: float = 0.0  # copy-out from the KV cache to host memory
    write_s: float = 0.0  # encode and write to storage
    bytes_in_flight: int = 0  # the writer's in-flight bytes right after this copy-out
    codec: str = "raw"  # how the object stores its states (service.codecs)
    layer_ids: tuple[int, ...] = ()  # the layers it holds


class Extractor:
    """Runs prompts through vLLM and returns the keys of their hidden-state objects."""

    def __init__(
        self,
        settings: Settings,
        engine: Any,
        receiver: CompletionReceiver,
        storage: Storage,
        info: ModelInfo,
        layer_ids: list[int],
        scratch: tempfile.TemporaryDirectory[str],
    ) -> None:
        self.settings, self.engine, self.info, self.layer_ids = settings, engine, info, layer_ids
        self._receiver, self._storage, self._scratch = receiver, storage, scratch
        self._receiver.on_orphan = self._remove_orphan
        self.dtype = str(engine.vllm_config.model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(engine.vllm_config.model_config.max_model_len)
        #: Highest in-flight byte count the writer reported (copied out, not yet durable).
        self.peak_bytes_in_flight = 0
        #: Requests handed to the engine so far (the API's tests count on it).
        self.requests_submitted = 0
        #: The codecs this server offers (service.codecs).
        self.codecs = codecs.offered(self.dtype)

    @property
    def storage(self) -> Storage:
        """The storage objects are written to (reads and deletes go through it)."""
        return self._storage

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (Hugging Face interface)."""
        return self.engine.tokenizer

    async def on_workers(self, method: str) -> list[Any]:
        """Call a ``HsxWorkerExtension`` method in every worker; one result per TP rank."""
        return list(await self.engine.collective_rpc(method, timeout=30))

    @property
    def alive(self) -> bool:
        """False once the engine has died."""
        return not self.engine.errored

    @classmethod
    async def start(cls, settings: Settings, *, storage_factory: str | None = None) -> Extractor:
        """Start the engine for ``settings.engine.model``.

        ``storage_factory`` ("module:callable") replaces ``open_storage`` in the worker;
        tests use it to inject storage faults. Raises ValueError for bad layer ids.
        """
        from vllm.v1.engine.async_llm import AsyncLLM

        model = settings.engine.model
        if model is None:
            raise ValueError("engine.model is not set")
        info = read_model_info(model)
        layer_ids = resolve_layer_ids(settings.engine.layer_ids, info.num_layers)
        scratch = tempfile.TemporaryDirectory(prefix="hsx-")
        receiver = CompletionReceiver(f"ipc://{Path(scratch.name) / 'completions.sock'}")
        receiver.start()
        args = engine_args(settings, info, layer_ids, receiver.address, storage_factory)
        try:
            engine = AsyncLLM.from_engine_args(args)
        except BaseException:
            await receiver.close()
            scratch.cleanup()
            raise
        storage = open_storage_with(storage_factory)(settings.storage)
        extractor = cls(settings, engine, receiver, storage, info, layer_ids, scratch)
        try:  # the served dtype is known only now ("auto")
            codecs.check_codec(settings.storage.codec, extractor.dtype)
        except ValueError as exc:
            await extractor.close()
            raise ValueError(f"storage.codec: {exc}") from None
        return extractor

    def check_codec(self, codec: str | None) -> str:
        """The codec a request gets (``storage.codec`` when None); ValueError naming the
        codecs offered otherwise."""
        return codecs.check_codec(codec or self.settings.storage.codec, self.dtype)

    def check_layers(self, layers: Sequence[int] | None) -> None:
        """ValueError unless ``layers`` is None or a subset of the served layer ids, in
        their order (objects keep the server's layer order)."""
        if layers is None:
            return
        wanted = list(layers)
        if not wanted or wanted != [i for i in self.layer_ids if i in wanted]:
            raise ValueError(
                f"{wanted} is not a non-empty subset of the served layer ids "
                f"{self.layer_ids} in that order"
            )

    async def extract(
        self,
        prompt_token_ids: Sequence[int],
        *,
        namespace: str,
        max_tokens: int = 1,
        include_output_tokens: bool = False,
        metadata: Mapping[str, str] | None = None,
        codec: str | None = None,
        layers: Sequence[int] | None = None,
    ) -> Extraction:
        """Run one prompt; return its object once durable.

        ``codec`` (``service.codecs``; default ``storage.codec``) says how the object
        stores its states, ``layers`` which of the served layer ids it holds (default
        all). Raises ValueError for a codec or layers not served (before the engine
        sees anything), InvalidPromptError, StorageWriteError, EngineUnavailableError.
        If the caller is cancelled, the engine request is aborted and no object remains.
        """
        codec = self.check_codec(codec)
        self.check_layers(layers)
        stored = tuple(layers if layers is not None else self.layer_ids)
        key = new_object_key(self.settings.storage.key_prefix, namespace)
        waiter = self._receiver.expect(key)
        try:
            output = await self._generate(
                key,
                list(prompt_token_ids),
                max_tokens,
                include_output_tokens,
                metadata,
                codec=codec,
                layers=list(layers) if layers is not None else None,
            )
            completion = await waiter
        except BaseException:
            self._receiver.abandon(key)
            raise
        self.peak_bytes_in_flight = max(self.peak_bytes_in_flight, completion.bytes_in_flight)
        if not completion.ok:
            raise StorageWriteError(completion.error)
        return _extraction(completion, output, codec, stored)

    async def _generate(
        self,
        key: str,
        prompt: list[int],
        max_tokens: int,
        include_output_tokens: bool,
        metadata: Mapping[str, str] | None,
        *,
        codec: str,
        layers: list[int] | None,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            detokenize=False,
            extra_args={
                REQUEST_ARG: {
                    "key": key,
                    "include_output_tokens": include_output_tokens,
                    "metadata": dict(metadata or {}),
                    "codec": codec,
                    "layers": layers,
                }
            },
        )
        final = None
        self.requests_submitted += 1
        try:
            stream = self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, f"hsx-{uuid.uuid4().hex}"
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
        """A cancelled request's object was written anyway: remove it."""
        if completion.ok:
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
    generated = tuple(output.outputs[0].token_ids) if output.outputs else ()
    return Extraction(
        key=completion.key,
        uri=completion.uri,
        size=completion.size,
        sha256=completion.sha256,
        num_tokens=completion.num_tokens,
        shape=completion.shape,
        prompt_tokens=len(output.prompt_token_ids or ()),
        output_token_ids=generated,
        copy_s=completion.copy_s,
        write_s=completion.write_s,
        bytes_in_flight=completion.bytes_in_flight,
        codec=codec,
        layer_ids=layer_ids,
    )
