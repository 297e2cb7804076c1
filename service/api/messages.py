"""Chat messages as chat templates take them, whichever dialect sent them.

vLLM's request models admit TypedDicts and pydantic messages; the chat template wants
plain dicts with text content and parsed tool-call arguments, the way vLLM's renderer
passes them on. Generic: used by the loss masks (``service.api.loss``), which the
OpenAI dialect and ``/extract`` share, and dialect-free (imports nothing of ours).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any


def as_mapping(message: Any) -> dict[str, Any]:
    """A chat message as a plain dict: vLLM's request model admits TypedDicts and
    pydantic messages (``openai_harmony``'s among them)."""
    if isinstance(message, dict):
        return message
    dump = getattr(message, "model_dump", None)
    return dict(dump()) if callable(dump) else {}


def plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates take it, the way vLLM's renderer passes it on:
    text parts joined with newlines, tool-call arguments parsed from their JSON."""
    plain = dict(message)
    content = plain.get("content")
    if isinstance(content, list):
        plain["content"] = "\n".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    if plain.get("tool_calls"):
        plain["tool_calls"] = [
            _plain_tool_call(call) if isinstance(call, dict) else call
            for call in plain["tool_calls"]
        ]
    return plain


def _plain_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    plain = dict(call)
    function = dict(plain.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # Left as sent when not JSON: the alignment check catches a template that differs.
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(arguments)
    plain["function"] = function
    return plain
