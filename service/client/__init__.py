"""A Python client for hsx, for trainers: no vLLM, only httpx, safetensors, torch and
zstandard (through ``service.codecs``, which decodes every codec to model-dtype states).

``HsxClient`` extracts, reads and deletes objects over HTTP; ``HsxTransfer`` is an
``hs_connectors.HiddenStatesTransfer`` that reads the objects named in
``kv_transfer_params`` through ``GET /objects/{key}`` (following S3's presigned
redirect), so a trainer without the server's filesystem passes it to speculators'
``ArrowDataset(..., transfer=HsxTransfer(url, api_key))``.
"""

from service.client.http import HsxClient, HsxError
from service.client.transfer import HsxTransfer

__all__ = ["HsxClient", "HsxError", "HsxTransfer"]
