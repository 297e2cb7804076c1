"""The hsx servers a run talks to: what each one serves, checked before anything is written."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from service.client import AsyncHsxClient, HsxError
from service.client.models import ModelCard


class EndpointError(Exception):
    """No usable hsx endpoint, or endpoints that disagree."""


@dataclass(frozen=True)
class ServerInfo:
    """``GET /v1/models`` (its first model) and ``GET /version`` of one hsx server."""

    url: str
    card: ModelCard
    version: str

    def same_model(self, other: ServerInfo) -> bool:
        keys = ("id", "layer_ids", "hidden_size", "dtype", "tokenizer_sha256")
        if not all(getattr(self.card, k) == getattr(other.card, k) for k in keys):
            return False
        # Replicas must serve the same weights; one that does not say cannot be compared.
        mine, theirs = (s.card.provenance.get("weights_sha256") for s in (self, other))
        return mine is None or theirs is None or mine == theirs

    def describe(self) -> str:
        card = self.card
        return f"{self.url} serves {card.id} {card.layer_ids} {card.dtype}"


async def probe(client: AsyncHsxClient) -> ServerInfo:
    """What the client's server serves; :class:`EndpointError` if it is not hsx."""
    url = client.base_url
    try:
        models = await client.models()
    except httpx.TransportError as exc:
        raise EndpointError(f"{url}: cannot connect ({type(exc).__name__}: {exc})") from None
    except HsxError as exc:
        if exc.status == 401:
            raise EndpointError(
                f"{url}: the API key was refused (401); pass --api-key or HSX_API_KEY"
            ) from None
        raise _not_hsx(url, exc.status) from None
    if not models.data:
        raise _not_hsx(url, 200)
    try:
        version = await client.version()
    except httpx.TransportError as exc:
        raise EndpointError(f"{url}: cannot connect ({type(exc).__name__}: {exc})") from None
    except HsxError:
        raise _not_hsx(url, 200) from None
    return ServerInfo(url, models.data[0], version.version)


def _not_hsx(url: str, status: int) -> EndpointError:
    return EndpointError(
        f"{url}: not an hsx server (GET /v1/models gave {status} "
        "without layer_ids, or GET /version has no version)"
    )


async def probe_all(
    clients: list[AsyncHsxClient],
) -> tuple[ServerInfo, list[ServerInfo], list[str]]:
    """The reference server, every reachable one, and a warning per unreachable one.

    An endpoint that answers but is not hsx, or serves another model, is an error; one
    that does not answer is left out with a warning (a replica may be down), unless
    none answers.
    """
    infos: list[ServerInfo] = []
    warnings: list[str] = []
    for client in clients:
        try:
            infos.append(await probe(client))
        except EndpointError as exc:
            if "cannot connect" not in str(exc):
                raise
            warnings.append(str(exc))
    if not infos:
        raise EndpointError("no endpoint answers: " + "; ".join(warnings))
    first = infos[0]
    for other in infos[1:]:
        if not first.same_model(other):
            raise EndpointError(f"{other.describe()}, but {first.describe()}")
    return first, infos, warnings
