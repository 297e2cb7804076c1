"""What the HTTP API needs from an extractor: structural types, so the API runs against
the real engine (``service.engine.extractor.Extractor``) or a test double
(``tests/api/fake.py``) without importing vLLM.

``ApiState.extractor`` is typed as :class:`ExtractorLike`; the OpenAI routes reach
vLLM's request front end only through its ``front_end`` (:class:`FrontEnd`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.registry import Collector

from service.codecs import Codec
from service.engine.provenance import Provenance
from service.engine.wire import Extraction, Generated, RequestParams, Sampling
from service.storage import Storage

if TYPE_CHECKING:  # vLLM's protocol models, for the reader (mypy sees them as Any)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest


class ModelInfoLike(Protocol):
    """The served model (``service.engine.builder.ModelInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class FrontEnd(Protocol):
    """vLLM's request front end for the served model (``service.engine.front_end``).

    Each call answers what ``vllm serve`` answers for the same request: a result, or
    vLLM's ``ErrorResponse`` (or raises what vLLM's renderer raises); the routes turn
    those into OpenAI errors.
    """

    async def check_model(self, model: str | None) -> Any:
        """None when ``model`` is the served one or not named; else vLLM's 404."""

    async def completion_token_ids(self, body: CompletionRequest) -> Any:
        """Each prompt's token ids (``list[list[int]]``), as ``/v1/completions``
        renders them."""

    async def chat_token_ids(self, body: ChatCompletionRequest) -> Any:
        """The conversation's token ids (``list[int]``), as ``/v1/chat/completions``
        renders them."""

    async def render_chat(self, body: ChatCompletionRequest, request: Any) -> Any:
        """vLLM's ``GenerateRequest`` for ``/v1/chat/completions/render``."""

    async def render_completion(self, body: CompletionRequest, request: Any) -> Any:
        """vLLM's ``GenerateRequest`` list for ``/v1/completions/render``."""

    async def tokenize(self, body: TokenizeRequest, request: Any) -> Any:
        """vLLM's ``TokenizeResponse`` (``/tokenize``)."""

    async def detokenize(self, body: DetokenizeRequest, request: Any) -> Any:
        """vLLM's ``DetokenizeResponse`` (``/detokenize``)."""


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

    def check_codec(self, codec: str | None) -> Codec:
        """The codec a request gets; ValueError naming the codecs offered otherwise."""

    def check_layers(self, layers: Sequence[int] | None) -> None:
        """ValueError unless ``layers`` is None or a subset of the served layer ids."""

    @property
    def provenance(self) -> Provenance:
        """What makes this server's states (every object's ``hsx.provenance.*``)."""

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (``encode``, ``apply_chat_template``), or None."""

    @property
    def front_end(self) -> FrontEnd:
        """vLLM's request front end for the served model (the OpenAI routes')."""

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
        self, prompt_token_ids: Sequence[int], params: RequestParams, *, max_tokens: int = 1
    ) -> Extraction:
        """One prompt's object under ``params.key``, once durable; cancelling leaves no
        object behind. ``params`` were checked against this server (codec, layers)."""

    async def generate(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> Generated:
        """Generate from the prompt, storing nothing (regeneration's turns); the same
        errors as :meth:`extract`."""

    @property
    def prefix_block_size(self) -> int | None:
        """Tokens per block of the prefix cache; None when prefix caching is off."""

    async def on_workers(self, method: str) -> list[Any]:
        """A worker-extension call on every worker."""

    async def close(self) -> None:
        """Stop the engine; every object written so far is durable or removed."""
