"""What an export wrote, and its record beside the samples: ``lengths.jsonl`` (one line
per sample: ``index``, ``file``, ``row``, ``custom_id``, ``num_tokens``,
``num_loss_tokens``), the vocabulary maps (``--vocab-map``) and ``hsx-export.json``,
the manifest, written last (its presence means a complete export). The manifest says
which layout, which layers in hsx's and the trainer's ids, on which side of the final
norm the last layer is (``last_layer_norm``: ``before``, ``after`` or None for aux
layers only), the norm applied and where it came from, the objects' own layer
convention, and the rows left out for non-finite values.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.config import S3StorageSettings
from service.dataset.layouts import DATA_DIR, Format, Layout
from service.dataset.manifest import Record

if TYPE_CHECKING:
    from service.dataset.export_model import ModelFacts
    from service.dataset.export_sinks import Read
    from service.dataset.final_norm import FinalNorm

MANIFEST = "hsx-export.json"
LENGTHS = "lengths.jsonl"


@dataclass(frozen=True)
class ExportOptions:
    """What ``hsx dataset export`` was asked for (the CLI's flags)."""

    format: Format = "speculators"
    #: SpecForge's strategy: ``eagle3`` (aux + last layer) or ``dflash`` (aux only).
    specforge_layout: str = "eagle3"
    #: Aux layers in the trainer's ids (None: the trainer's default for the model).
    aux_layers: list[int] | None = None
    #: The target model's directory or Hugging Face id (final norm, layer count, vocab).
    model: str | None = None
    #: gzip each file (SpecForge's ``.ckpt.gz``).
    compress: bool = False
    #: Draft vocabulary size of ``d2t``/``t2d`` to write (None: none).
    vocab_map: int | None = None
    api_key: str | None = None
    concurrency: int = 8
    s3: S3StorageSettings | None = None
    allow_partial: bool = False


@dataclass
class Exported:
    """What an export wrote: counts, the length index, the supervised tokens' counts,
    the rows left out, and the plan it followed."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    left_out: list[dict[str, Any]] = field(default_factory=list)
    lengths: list[dict[str, Any]] = field(default_factory=list)
    #: Supervised token id -> count, filled in export order (ModelOpt's map keeps it).
    freq: Counter[int] = field(default_factory=Counter)
    dtype: str | None = None
    #: Seconds spent reading, converting and writing the samples (imports excluded).
    samples_s: float = 0.0
    layout: Layout | None = None
    #: The run's layer ids (hsx's).
    held: list[int] = field(default_factory=list)
    #: The final norm applied to the last layer (None: none).
    norm: FinalNorm | None = None
    #: The final-norm side of the last layer in the run's objects.
    side: str = "before"
    #: The layer convention the run's server stated (None: it stated none).
    convention: str | None = None

    def count(self, name: str, size: int, record: Record, read: Read) -> None:
        """Count sample ``self.samples``, written to ``name`` in ``size`` bytes."""
        tokens, loss = int(read.token_ids.numel()), int(read.loss_mask.sum())
        mask = read.loss_mask.tolist()
        self.freq.update(int(t) for t, m in zip(read.token_ids.tolist(), mask, strict=True) if m)
        self.lengths.append(
            {
                "index": self.samples,
                "file": name,
                "row": record.row,
                "custom_id": record.custom_id,
                "num_tokens": tokens,
                "num_loss_tokens": loss,
            }
        )
        self.samples += 1
        self.tokens += tokens
        self.loss_tokens += loss
        self.bytes += size
        self.dtype = self.dtype or str(read.states.dtype).removeprefix("torch.")


def write_record(
    dest: Path,
    output: str,
    done: Exported,
    facts: ModelFacts,
    options: ExportOptions,
    started: float,
) -> None:
    """The length index, the vocabulary maps, then the manifest (module docstring)."""
    from service import __version__
    from service.dataset.vocab_map import write_vocab_maps

    assert done.layout is not None
    layout = done.layout
    with (dest / LENGTHS).open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(line) + "\n" for line in done.lengths)
    vocab = None
    if options.vocab_map is not None:
        assert facts.vocab_size is not None  # resolve_model refuses a map without it
        vocab = write_vocab_maps(dest, done.freq, options.vocab_map, facts.vocab_size)
    side = layout.side or ("before" if layout.format == "speculators" else None)
    manifest = {
        "hsx_export_version": 1,
        "format": layout.format,
        "layout": layout.name,
        "hsx_version": __version__,
        "source": output,
        "model": facts.path,
        "data": "." if layout.format == "speculators" else DATA_DIR,
        "samples": done.samples,
        "tokens": done.tokens,
        "loss_tokens": done.loss_tokens,
        "bytes": done.bytes,
        "dtype": done.dtype,
        "compress": options.compress,
        "layers": {
            "held_hsx_ids": done.held,
            "aux_hsx_ids": list(layout.aux),
            "aux_trainer_ids": layout.trainer_aux,
            "last_hsx_id": layout.last,
            "num_hidden_layers": facts.num_layers,
        },
        "last_layer_norm": side,
        "last_layer": _last_words(side),
        "final_norm": None if done.norm is None else {"applied": True, **done.norm.describe()},
        "objects": {"layer_convention": done.convention, "norm_side": done.side},
        "left_out": done.left_out,
        "vocab_map": vocab,
        "lengths": LENGTHS,
        "elapsed_s": round(time.monotonic() - started, 3),
        "samples_s": round(done.samples_s, 3),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _last_words(side: str | None) -> str:
    if side is None:
        return "no last layer: aux layers only"
    return f"the last layer (id num_hidden_layers) is {side} the final norm"
