"""vLLM's ``ExampleHiddenStatesConnector`` on a CPU-only machine: the peer that
``vllm serve`` runs in the as-shipped bench (``benchmarks/shipped_bench.py``).

The stock connector (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) copies each finished request's hidden states out of
the KV cache with CUDA calls, which fail without a GPU. :class:`CpuHiddenStatesConnector`
replaces exactly those calls and nothing else:

* ``torch.cuda.Stream()`` (``_get_copy_stream``), ``torch.cuda.stream(copy_stream)`` and
  ``copy_stream.wait_event(ready_event)``: the gather runs on the calling thread, as
  every CPU op does;
* ``torch.cuda.Event()`` + ``.record()`` (the ready event and the copy-done event):
  an event that is always complete, so ``get_finished``'s ``event.query()`` and
  ``_write_tensors``'s ``event.synchronize()`` return at once;
* ``slot_mapping.to(device=..., non_blocking=True)`` under ``gpu_sync_allowed`` and the
  pinned host buffer (``torch.empty_like(..., pin_memory=True)`` + ``copy_``): the cache
  is in host memory already, and ``extract_from_kv_cache``'s fancy indexing returns a
  fresh host tensor, which is what the pinned copy held.

Everything else is the stock connector's: the scheduler side, the lock file created in
``wait_for_save`` with ``LOCK_EX`` held, the slot mapping, its pool of writer threads,
``safetensors.torch.save_file`` (no fsync, no checksum) and the lock's release once the
file is written. ``vllm serve`` loads it by name
(``--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
"kv_connector_module_path": "benchmarks.cpu_connector", ...}'``). It is a subclass of
vLLM's public connector: the attributes it reads are its own (inherited). A client
counts a request done once it gets ``LOCK_SH`` on ``<file>.lock``, as vLLM's
``load_hidden_states`` and speculators' ``generate-offline-data`` wait
(``benchmarks/completions_client.py``). The same class drives the in-process peer lab:
``experiments/peer_lab/peer_connector.py``.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class DoneEvent:
    """Stands in for ``torch.cuda.Event``: on CPU the copy is done when it returns."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock connector with its CUDA stream, event and pinned-copy calls replaced."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """The stock method, line for line, minus its CUDA calls (module docstring)."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids_t = torch.tensor(pending.block_ids, dtype=torch.long)
        num_blocks = block_ids_t.shape[0]
        block_offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (
            block_offsets.reshape((1, self._block_size))
            + block_ids_t.reshape((num_blocks, 1)) * self._block_size
        ).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Replaces the copy stream, the pinned buffer and its non-blocking copy.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens)
        copy_done = DoneEvent()  # replaces torch.cuda.Event() + record(copy_stream)
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        prior = self._req_futures.get(pending.req_id)
        assert prior is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
            lock_fd = os.open(pending.filename + ".lock", flags, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(
            self._write_tensors, tensors, copy_done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = copy_done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _get_copy_stream(self) -> Any:
        """Never called on CPU (``_submit_async_write`` needs no stream)."""
        raise RuntimeError("no CUDA stream on the CPU connector")
