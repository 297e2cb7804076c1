"""vLLM's own request front end, built on hsx's engine: renderer, render and tokenize.

The OpenAI-compatible routes parse with vLLM's protocol models and render prompts
(chat templates, tools, truncation) with vLLM's ``OnlineRenderer`` and
``ServingRender``, the objects ``vllm serve`` itself uses, so hsx's token ids cannot
drift from vLLM's. Only the serving path differs: prompts go through hsx's extractor,
which answers once every object is durable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request


@dataclass(frozen=True)
class VllmFrontEnd:
    """vLLM's serving helpers for one engine, as ``vllm serve`` builds them."""

    registry: Any  # OpenAIModelRegistry: the served model name, its check (404)
    renderer: Any  # OnlineRenderer: prompts of /v1/completions and /v1/chat/completions
    render: Any  # ServingRender: /v1/*/render
    tokenization: Any  # ServingTokenization: /tokenize, /detokenize

    @classmethod
    def build(cls, engine: Any, model_name: str) -> VllmFrontEnd:
        """The helpers for ``engine`` (an ``AsyncLLM``) serving ``model_name``.

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

        model_config = engine.model_config
        registry = OpenAIModelRegistry(
            model_config=model_config,
            base_model_paths=[BaseModelPath(name=model_name, model_path=model_config.model)],
        )
        renderer = OnlineRenderer(
            model_config=model_config,
            renderer=engine.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            enable_auto_tools=True,
        )
        tokenization = ServingTokenization(
            registry, renderer, chat_template=None, chat_template_content_format="auto"
        )
        return cls(registry, renderer, ServingRender(registry, renderer), tokenization)

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

    def _token_ids(self, engine_input: Any) -> list[int]:
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        token_ids = extract_prompt_components(self.renderer.model_config, engine_input).token_ids
        if not token_ids:  # ServingRender's words for the same case
            raise ValueError("No token_ids rendered")
        return list(token_ids)


def front_end(request: Request) -> VllmFrontEnd:
    """The app's front end, built on first use (the engine starts in the lifespan)."""
    app_state = request.app.state
    built: VllmFrontEnd | None = getattr(app_state, "hsx_vllm_front_end", None)
    if built is None:
        extractor = app_state.hsx.extractor
        built = VllmFrontEnd.build(extractor.engine, app_state.hsx.model_name)
        app_state.hsx_vllm_front_end = built
    return built
