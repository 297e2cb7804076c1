"""Where an export's samples go: one sink per layout family, each turning a read-back
object into its trainer's tensors (``prepare``) and writing them (``write``).

Both run off the event loop (``asyncio.to_thread``); ``prepare`` may run for several
samples at once, ``write`` runs for one sample at a time, in export order, so indices
are dense (speculators pairs ``hs_{i}`` with dataset row ``i``; SpecForge's ``data_{i}``
is the sample's global index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.dataset.layouts import Layout, convert, relative_path, serialize

if TYPE_CHECKING:
    import torch

    from service.dataset.final_norm import FinalNorm


@dataclass
class Read:
    """One object as read back: its ids, mask and held layers' states."""

    custom_id: str
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    states: torch.Tensor


class Sink:
    """The interface: prepare a sample's tensors, write them, finish the export."""

    def prepare(self, read: Read) -> dict[str, Any]:
        """The trainer's tensors for ``read`` (may run concurrently)."""
        raise NotImplementedError

    def write(self, index: int, read: Read, tensors: dict[str, Any]) -> tuple[str, int]:
        """Write sample ``index``; its path under DEST and its bytes."""
        raise NotImplementedError

    def finish(self) -> None:
        """Write what covers every sample (speculators' Arrow rows)."""


@dataclass
class SpeculatorsSink(Sink):
    """``hidden_states/hs_{i}.safetensors`` plus a ``datasets`` directory and
    ``token_freq.pt``: speculators' ``prepare-data`` + offline layout, every held layer
    as stored (before the final norm, as speculators reads it)."""

    dest: Path
    columns: dict[str, list[Any]] = field(
        default_factory=lambda: {"input_ids": [], "loss_mask": [], "seq_len": []}
    )

    def __post_init__(self) -> None:
        (self.dest / "hidden_states").mkdir(parents=True, exist_ok=True)

    def prepare(self, read: Read) -> dict[str, Any]:
        return {"hidden_states": read.states, "token_ids": read.token_ids}

    def write(self, index: int, read: Read, tensors: dict[str, Any]) -> tuple[str, int]:
        from safetensors.torch import save_file

        name = f"hidden_states/hs_{index}.safetensors"
        save_file(tensors, str(self.dest / name))
        ids = [int(t) for t in read.token_ids.tolist()]
        self.columns["input_ids"].append(ids)
        self.columns["loss_mask"].append([int(m) for m in read.loss_mask.tolist()])
        self.columns["seq_len"].append(len(ids))
        return name, (self.dest / name).stat().st_size

    def finish(self) -> None:
        import torch
        from datasets import Dataset  # type: ignore[import-untyped]

        dataset = Dataset.from_dict(self.columns)
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(self.dest))
        counts: dict[int, int] = {}
        for ids, mask in zip(self.columns["input_ids"], self.columns["loss_mask"], strict=True):
            for token, supervised in zip(ids, mask, strict=True):
                if supervised:
                    counts[token] = counts.get(token, 0) + 1
        torch.save(counts, self.dest / "token_freq.pt")


@dataclass
class TorchSink(Sink):
    """``torch.save`` dicts of SpecForge, ModelOpt or EAGLE (``service.dataset.layouts``)."""

    dest: Path
    layout: Layout
    held: list[int]
    norm: FinalNorm | None
    compress: bool
    taken: set[str] = field(default_factory=set)

    def prepare(self, read: Read) -> dict[str, Any]:
        return convert(
            self.layout,
            read.states,
            self.held,
            read.token_ids,
            read.loss_mask,
            read.custom_id,
            self.norm,
        )

    def write(self, index: int, read: Read, tensors: dict[str, Any]) -> tuple[str, int]:
        name = relative_path(self.layout, index, read.custom_id, self.compress)
        if name in self.taken:  # a custom_id exported twice (ModelOpt names files by it)
            name = relative_path(self.layout, index, "", self.compress)
        self.taken.add(name)
        data = serialize(tensors, self.compress)
        path = self.dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return name, len(data)
