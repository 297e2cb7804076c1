"""``HsxClient``: ``POST /extract``, ``GET`` and ``DELETE /objects/{key}`` over httpx.

Objects are decoded here, by ``service.codecs`` (torch, safetensors and zstandard
only), so a reader gets model-dtype states whatever codec stored them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

Prompt = str | Sequence[int] | Mapping[str, Any]


class HsxError(Exception):
    """hsx answered with an error: ``status``, ``type`` and the server's message."""

    def __init__(self, status: int, type: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message, self.body = status, type, message, body


class HsxClient:
    """A synchronous client of one hsx server; one connection pool, reused.

    ``api_key`` is sent as ``Authorization: Bearer``; it is never sent on to the
    presigned S3 URL that ``GET /objects/{key}`` redirects to (httpx drops it across
    origins).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout,
            follow_redirects=True,
            transport=transport,
        )

    def extract(
        self,
        prompts: Sequence[Prompt],
        *,
        max_tokens: int = 1,
        include_output_tokens: bool = False,
        metadata: Mapping[str, str] | None = None,
        codec: str | None = None,
        layers: Sequence[int] | None = None,
        loss: str | None = None,
    ) -> dict[str, Any]:
        """``POST /extract``: the response, whose every object is durable.

        A prompt is text, a list of token ids, or an object with one of ``text``,
        ``token_ids``, ``messages``. ``codec``, ``layers`` and ``loss`` are sent only
        when given (the server's default codec, all its layers, no mask otherwise).
        Raises HsxError on any error answer.
        """
        body: dict[str, Any] = {
            "prompts": [_prompt(p) for p in prompts],
            "max_tokens": max_tokens,
            "include_output_tokens": include_output_tokens,
            "metadata": dict(metadata or {}),
        }
        if codec is not None:
            body["codec"] = codec
        if layers is not None:
            body["layers"] = list(layers)
        if loss is not None:
            body["loss"] = loss
        return dict(_checked(self._http.post("/extract", json=body)).json())

    def get_bytes(self, key: str, *, decode: bool = False) -> bytes:
        """The object's safetensors bytes as stored (from S3 through the presigned
        redirect); with ``decode``, as a ``raw`` object (model-dtype states)."""
        data = _checked(self._http.get(f"/objects/{key}")).content
        if not decode:
            return data
        from service.codecs import to_raw

        return to_raw(data)

    def get(self, key: str) -> dict[str, Any]:
        """The object's tensors: ``hidden_states`` in the model dtype whatever the
        codec, ``token_ids``, and ``loss_mask`` where stored (torch)."""
        return decode_object(self.get_bytes(key))

    def delete(self, key: str) -> None:
        """Remove the object; HsxError (404) if it is not there."""
        _checked(self._http.delete(f"/objects/{key}"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HsxClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def decode_object(data: bytes) -> dict[str, Any]:
    """An object's tensors, its states decoded to the model dtype (any codec)."""
    from service.codecs import decode

    tensors, _ = decode(data)
    return dict(tensors)


def _prompt(prompt: Prompt) -> Any:
    if isinstance(prompt, str | Mapping):
        return prompt
    return {"token_ids": list(prompt)}


def _checked(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        body = response.json()
        error = body["error"]
        kind, message = str(error.get("type", "error")), str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        body, kind, message = response.text, "error", response.text[:500]
    raise HsxError(response.status_code, kind, message, body)
