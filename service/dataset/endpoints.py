"""The hsx servers a run talks to: what each one serves, checked before anything is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx


class EndpointError(Exception):
    """No usable hsx endpoint, or endpoints that disagree."""


@dataclass
class ServerInfo:
    """``GET /v1/models`` and ``GET /version`` of one hsx server."""

    url: str
    model: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    max_model_len: int
    version: str
    default_codec: str = "raw"
    tokenizer_sha256: str | None = None
    chat_template_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def same_model(self, other: ServerInfo) -> bool:
        keys = ("model", "layer_ids", "hidden_size", "dtype", "tokenizer_sha256")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def probe(client: httpx.AsyncClient, url: str) -> ServerInfo:
    """What ``url`` serves; :class:`EndpointError` if it is not an hsx server."""
    try:
        models = await client.get(f"{url}/v1/models")
        version = await client.get(f"{url}/version")
    except httpx.TransportError as exc:
        raise EndpointError(f"{url}: cannot connect ({type(exc).__name__}: {exc})") from None
    if models.status_code == 401:
        raise EndpointError(f"{url}: the API key was refused (401); pass --api-key or HSX_API_KEY")
    card = _first_card(models)
    if card is None or version.status_code != 200 or "version" not in _json(version):
        raise EndpointError(
            f"{url}: not an hsx server (GET /v1/models gave {models.status_code} "
            "without layer_ids, or GET /version has no version)"
        )
    return ServerInfo(
        url=url,
        model=str(card["id"]),
        layer_ids=[int(i) for i in card["layer_ids"]],
        hidden_size=int(card["hidden_size"]),
        dtype=str(card["dtype"]),
        max_model_len=int(card["max_model_len"]),
        version=str(_json(version)["version"]),
        default_codec=str(card.get("default_codec", "raw")),
        tokenizer_sha256=card.get("tokenizer_sha256"),
        chat_template_sha256=card.get("chat_template_sha256"),
        extra={k: v for k, v in card.items() if k in ("codecs",)},
    )


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {}


def _first_card(response: httpx.Response) -> dict[str, Any] | None:
    body = _json(response) if response.status_code == 200 else {}
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    card = data[0]
    needed = ("id", "layer_ids", "hidden_size", "dtype", "max_model_len")
    return card if all(k in card for k in needed) else None


async def probe_all(
    client: httpx.AsyncClient, urls: list[str]
) -> tuple[ServerInfo, list[ServerInfo], list[str]]:
    """The reference server, every reachable one, and a warning per unreachable one.

    An endpoint that answers but is not hsx, or serves another model, is an error; one
    that does not answer is left out with a warning (a replica may be down), unless
    none answers.
    """
    infos: list[ServerInfo] = []
    warnings: list[str] = []
    for url in urls:
        try:
            infos.append(await probe(client, url))
        except EndpointError as exc:
            if "cannot connect" not in str(exc):
                raise
            warnings.append(str(exc))
    if not infos:
        raise EndpointError("no endpoint answers: " + "; ".join(warnings))
    first = infos[0]
    for other in infos[1:]:
        if not first.same_model(other):
            raise EndpointError(
                f"{other.url} serves {other.model} {other.layer_ids} {other.dtype}, "
                f"but {first.url} serves {first.model} {first.layer_ids} {first.dtype}"
            )
    return first, infos, warnings


async def tokenize_count(
    client: httpx.AsyncClient, url: str, model: str, prompt: dict[str, Any]
) -> int | None:
    """Tokens of a prompt via ``POST /tokenize`` (vLLM's shape); None if unsupported."""
    if "token_ids" in prompt:
        return len(prompt["token_ids"])
    body: dict[str, Any] = {"model": model}
    if "messages" in prompt:
        body["messages"] = prompt["messages"]
        body["add_generation_prompt"] = prompt["messages"][-1]["role"] != "assistant"
    else:
        body["prompt"] = prompt["text"]
    response = await client.post(f"{url}/tokenize", json=body)
    if response.status_code in (404, 405):
        return None
    response.raise_for_status()
    return int(response.json()["count"])
