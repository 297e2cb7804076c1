"""A Python client for hsx, for trainers: no vLLM, only httpx, safetensors, torch and
zstandard (through ``service.codecs``, which decodes every codec to model-dtype states).

``AsyncHsxClient`` and its synchronous twin ``HsxClient`` extract, tokenize, read and
delete objects over HTTP and answer with the server's own response models
(``service.client.models``); every error answer is one :class:`HsxError`.
``HsxTransfer`` is an ``hs_connectors.HiddenStatesTransfer`` that reads the objects
named in ``kv_transfer_params`` through ``GET /objects/{key}`` (following S3's presigned
redirect), so a trainer without the server's filesystem passes it to speculators'
``ArrowDataset(..., transfer=HsxTransfer(url, api_key))``.

The names load lazily, so the server can import ``service.client.models`` without httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.client._base import BadResponseError, ExtractOptions, HsxError, encode_extract
    from service.client.asynchronous import AsyncHsxClient
    from service.client.http import HsxClient
    from service.client.transfer import HsxTransfer

_WHERE = {
    "AsyncHsxClient": "service.client.asynchronous",
    "BadResponseError": "service.client._base",
    "ExtractOptions": "service.client._base",
    "HsxClient": "service.client.http",
    "HsxError": "service.client._base",
    "HsxTransfer": "service.client.transfer",
    "encode_extract": "service.client._base",
}

__all__ = [
    "AsyncHsxClient",
    "BadResponseError",
    "ExtractOptions",
    "HsxClient",
    "HsxError",
    "HsxTransfer",
    "encode_extract",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'service.client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
