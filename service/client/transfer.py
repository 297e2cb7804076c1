"""``HsxTransfer``: speculators reads hsx's objects over HTTP, wherever they are stored.

It implements ``hs_connectors.HiddenStatesTransfer`` (``setup``, ``get_cached``,
``get_generated``, ``delete``) without importing it, so this client needs neither
vLLM nor speculators. speculators' ``ArrowDataset`` calls ``get_generated`` with the
``kv_transfer_params`` of a ``/v1/completions`` answer, then ``delete`` with the
``hidden_states_path`` it read (on S3, an ``s3://`` URI): both are mapped back to the
object's key, and the object is read and removed through the API, under the caller's
key and namespace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from service.client.http import HsxClient, decode_object


class HsxTransfer:
    """Hidden states through hsx's ``/objects`` API, for ``ArrowDataset(transfer=...)``.

    ``cache_dir`` holds samples already written as ``hs_{i}.safetensors`` (by
    ``generate-offline-data``); without it every sample is generated on demand.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        cache_dir: str | Path | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.base_url, self.api_key, self.timeout = base_url, api_key, timeout
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._client: HsxClient | None = None
        self._pid: int | None = None
        #: handle or hidden_states_path -> key, for the generated samples not yet deleted
        self._keys: dict[str, str] = {}

    def setup(self) -> None:
        """Open the connection pool in this process (dataloader workers fork)."""
        self.client()

    def client(self) -> HsxClient:
        """This process's client: pooled sockets must not cross a fork."""
        if self._client is None or self._pid != os.getpid():
            self._client = HsxClient(self.base_url, self.api_key, timeout=self.timeout)
            self._pid = os.getpid()
        return self._client

    def get_cached(self, file_idx: int) -> dict[str, Any] | None:
        """A sample written earlier as ``cache_dir/hs_{file_idx}.safetensors``, or None;
        its states in the model dtype, whatever codec stored them."""
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"hs_{file_idx}.safetensors"
        if not path.is_file():
            return None
        return decode_object(path.read_bytes())

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, Any] | None:
        """The tensors of the object named by a completion's ``kv_transfer_params``
        (states in the model dtype, whatever the codec)."""
        key = str(hs_transfer_params["handle"])
        for name in ("handle", "hidden_states_path"):
            if hs_transfer_params.get(name):
                self._keys[str(hs_transfer_params[name])] = key
        return self.client().get(key)

    def delete(self, handle: str) -> None:
        """Remove the object named by ``handle`` (its key, or the path read with it)."""
        key = self._keys.get(handle, handle)
        self.client().delete(key)
        self._keys = {name: k for name, k in self._keys.items() if k != key}
