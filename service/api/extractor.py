"""What the HTTP API needs from an extractor: a structural type, so the API can be run
against the real engine (``service.engine.extractor.Extractor``) or a test double
(``tests/api/fake.py``) without importing vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.registry import Collector

from service.storage import Storage


class ModelInfoLike(Protocol):
    """The served model (``service.engine.builder.ModelInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class ExtractionLike(Protocol):
    """One durable object (``service.engine.extractor.Extraction``)."""

    @property
    def key(self) -> str: ...
    @property
    def uri(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def sha256(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_token_ids(self) -> tuple[int, ...]: ...
    @property
    def copy_s(self) -> float: ...
    @property
    def write_s(self) -> float: ...


class ExtractorLike(Protocol):
    """The engine as the routes use it."""

    @property
    def info(self) -> ModelInfoLike: ...
    @property
    def layer_ids(self) -> list[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def codecs(self) -> Sequence[str]:
        """The codecs this server offers for its dtype (``service.codecs.offered``)."""

    def check_codec(self, codec: str | None) -> Any:
        """The codec a request gets; ValueError naming the codecs offered otherwise."""

    def check_layers(self, layers: Sequence[int] | None) -> None:
        """ValueError unless ``layers`` is None or a subset of the served layer ids."""

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (``encode``, ``apply_chat_template``), or None."""

    @property
    def alive(self) -> bool:
        """False once the engine has died."""

    @property
    def storage(self) -> Storage:
        """Where objects are written; reads and deletes go through it."""

    @property
    def metrics(self) -> Collector:
        """Storage and writer metrics of the extractor; the app registers them."""

    async def extract(
        self,
        prompt_token_ids: Sequence[int],
        *,
        namespace: str,
        max_tokens: int = 1,
        include_output_tokens: bool = False,
        metadata: Mapping[str, str] | None = None,
        loss_spans: Sequence[tuple[int, int]] | None = None,
        key: str | None = None,
        codec: str | None = None,
        layers: Sequence[int] | None = None,
    ) -> ExtractionLike:
        """One prompt's object, once durable; cancelling leaves no object behind."""

    async def on_workers(self, method: str) -> list[Any]:
        """A worker-extension call on every worker."""

    async def close(self) -> None:
        """Stop the engine; every object written so far is durable or removed."""
