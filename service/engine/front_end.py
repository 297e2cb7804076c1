"""vLLM's own request front end for the served model: the model check, render, tokenize.

The OpenAI-compatible routes parse with vLLM's protocol models and render prompts
(chat templates, tools, truncation) with vLLM's ``OnlineRenderer`` and
``ServingRender``, the objects ``vllm serve`` itself uses, so hsx's token ids cannot
drift from vLLM's. Only the serving path differs: prompts go through hsx's extractor,
which answers once every object is durable.

:class:`VllmFrontEnd` is the ``front_end`` of ``service.api.extractor.ExtractorLike``.
The extractor builds it on its engine's model config and renderer; the same
construction without an engine (:meth:`VllmFrontEnd.without_engine`, as vLLM's
GPU-less render server does it) serves tests of the routes that need no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmFrontEnd:
    """vLLM's serving helpers for one model, as ``vllm serve`` builds them."""

    registry: Any  # OpenAIModelRegistry: the served model name, its check (404)
    renderer: Any  # OnlineRenderer: prompts of /v1/completions and /v1/chat/completions
    serving_render: Any  # ServingRender: /v1/*/render
    tokenization: Any  # ServingTokenization: /tokenize, /detokenize

    @classmethod
    def build(cls, model_config: Any, renderer: Any, model_name: str) -> VllmFrontEnd:
        """The helpers for a model (``model_config``, vLLM's ``renderer`` of it) served
        as ``model_name``.

        The same construction as vLLM's render server (``init_render_app_state``)
        with ``vllm serve``'s defaults (the model's own chat template, no tool or
        reasoning parser, no request-supplied templates), except that ``tools``
        with the default ``tool_choice="auto"`` are rendered, as with
        ``--enable-auto-tool-choice``: hsx renders prompts and never parses output.
        """
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
        from vllm.entrypoints.scale_out.render.serving import ServingRender
        from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
        from vllm.renderers.online_renderer import OnlineRenderer

        registry = OpenAIModelRegistry(
            model_config=model_config,
            base_model_paths=[BaseModelPath(name=model_name, model_path=model_config.model)],
        )
        online = OnlineRenderer(
            model_config=model_config,
            renderer=renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            enable_auto_tools=True,
        )
        tokenization = ServingTokenization(
            registry, online, chat_template=None, chat_template_content_format="auto"
        )
        return cls(registry, online, ServingRender(registry, online), tokenization)

    @classmethod
    def without_engine(
        cls, model: str, model_name: str, *, max_model_len: int, dtype: str = "float32"
    ) -> VllmFrontEnd:
        """The helpers for ``model`` (a directory with its config and tokenizer; no
        weights are read) with no engine, as vLLM's GPU-less render server builds them."""
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import renderer_from_config

        args = EngineArgs(model=model, dtype=dtype, max_model_len=max_model_len)
        model_config = args.create_model_config()
        renderer = renderer_from_config(VllmConfig(model_config=model_config))
        return cls.build(model_config, renderer, model_name)

    async def check_model(self, model: str | None) -> Any:
        """None when ``model`` is the served one (or not named), else vLLM's 404."""
        return await self.registry.check_model(model)

    async def completion_token_ids(self, body: Any) -> list[list[int]] | Any:
        """Each prompt's token ids, rendered as ``vllm serve``'s ``/v1/completions``
        renders them (``OnlineRenderer.render_completion``), or vLLM's ErrorResponse.

        The render routes answer with ``ServingRender``'s ``GenerateRequest`` (sampling
        parameters, request ids); the extraction routes need only the token ids, and
        going through ``ServingRender`` cost 0.32 ms of the event loop's CPU per
        one-prompt request where this costs 0.19 ms (measured; the bench row
        "/v1/completions vs /extract" in docs/benchmarks.md is what it is for).
        """
        result = await self.renderer.render_completion(body)
        if not isinstance(result, list):
            return result
        return [self._token_ids(engine_input) for engine_input in result]

    async def chat_token_ids(self, body: Any) -> list[int] | Any:
        """The conversation's token ids, as ``vllm serve``'s ``/v1/chat/completions``
        renders them (``OnlineRenderer.render_chat``), or vLLM's ErrorResponse."""
        result = await self.renderer.render_chat(body)
        if not isinstance(result, tuple):
            return result
        _, engine_inputs = result
        if len(engine_inputs) != 1:  # as ServingRender.render_chat_request refuses it
            raise ValueError(f"Expected exactly 1 engine prompt, got {len(engine_inputs)}")
        return self._token_ids(engine_inputs[0])

    async def render_chat(self, body: Any, request: Any) -> Any:
        """``/v1/chat/completions/render``: vLLM's GenerateRequest or ErrorResponse."""
        return await self.serving_render.render_chat_request(body, request)

    async def render_completion(self, body: Any, request: Any) -> Any:
        """``/v1/completions/render``: vLLM's GenerateRequests or ErrorResponse."""
        return await self.serving_render.render_completion_request(body, request)

    async def tokenize(self, body: Any, request: Any) -> Any:
        """``/tokenize``: vLLM's TokenizeResponse or ErrorResponse."""
        return await self.tokenization.create_tokenize(body, request)

    async def detokenize(self, body: Any, request: Any) -> Any:
        """``/detokenize``: vLLM's DetokenizeResponse or ErrorResponse."""
        return await self.tokenization.create_detokenize(body, request)

    def _token_ids(self, engine_input: Any) -> list[int]:
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        token_ids = extract_prompt_components(self.renderer.model_config, engine_input).token_ids
        if not token_ids:  # ServingRender's words for the same case
            raise ValueError("No token_ids rendered")
        return list(token_ids)
