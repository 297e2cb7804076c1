"""Trainer layouts of hidden states, and the conversion of one hsx object into each.

Where the trainers disagree (``docs/trainers.md``, "Trainer layouts"):

- **Layer ids.** hsx id ``i`` is the *input* of decoder layer ``i`` (vLLM's; 0 = the
  embeddings, ``L`` = the last layer's output). SpecForge and ModelOpt name a layer by
  the decoder layer whose *output* they take (SGLang captures ``val + 1``; ModelOpt
  hooks layer ``k``'s output), so their id is hsx's minus one. Their aux ids run from
  0 to ``L - 2``: the last layer's output is the separate "last" tensor.
- **The last layer's norm side.** hsx stores it before the final norm, as speculators
  reads it; SpecForge's EAGLE-3 ``hidden_state``, ModelOpt's ``hidden_states`` and
  EAGLE's ``hidden_state`` are after it (``service.dataset.final_norm``). DFlash takes
  aux layers only.
- **Files.** ``torch.save`` dicts: SpecForge at ``rows_{g}-{g+2000}/data_{i}.ckpt``
  (``.ckpt.gz`` compressed), ModelOpt at ``{conversation_id}.pt``, EAGLE at
  ``data_{i}.ckpt``; ids and masks int64, states in the run's dtype. They go under
  ``DEST/data/``, so the manifest, length index and vocabulary maps beside them are
  never read as samples (ModelOpt globs ``*.pt`` recursively, EAGLE reads every file).
"""

from __future__ import annotations

import gzip
import io
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from service.dataset.final_norm import FinalNorm

Format = Literal["speculators", "specforge", "modelopt", "eagle"]
Side = Literal["before", "after"]
#: SpecForge puts this many samples in each ``rows_{g}-{g+N}`` directory.
SPECFORGE_GROUP = 2000
#: The directory (under DEST) that holds the samples of the torch.save layouts.
DATA_DIR = "data"
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


class ExportError(Exception):
    """The run cannot be exported in this format (one line: why)."""


@dataclass(frozen=True)
class Layout:
    """One trainer's layout: which layers, and on which side of the final norm."""

    format: Format
    #: SpecForge's strategy (``eagle3``, ``dflash``); None for the other formats.
    variant: str | None
    #: Aux layers in hsx ids, concatenated in this order.
    aux: tuple[int, ...]
    #: hsx id of the last layer (``num_hidden_layers``) the layout stores; None: none.
    last: int | None
    #: The norm side the layout wants for ``last`` (None: no last layer, or speculators'
    #: whole stack as stored).
    side: Side | None

    @property
    def name(self) -> str:
        return f"{self.format}-{self.variant}" if self.variant else self.format

    @property
    def trainer_aux(self) -> list[int]:
        """The aux layers in the trainer's ids (hsx id minus one; speculators: hsx's)."""
        shift = 0 if self.format == "speculators" else 1
        return [i - shift for i in self.aux]

    def needed(self) -> list[int]:
        """Every hsx id this layout reads from an object."""
        return sorted({*self.aux, *([self.last] if self.last is not None else [])})


def default_aux(format: Format, variant: str | None, num_layers: int) -> list[int]:
    """The trainer's own default aux layers for a model of ``num_layers``, in its ids.

    SpecForge EAGLE-3: ``[1, L//2 - 1, L - 4]`` (``resolve_eagle_capture_layers``);
    ModelOpt: the same three, sorted and deduplicated (``default_eagle_aux_layer_ids``).
    SpecForge DFlash reads its ids from the draft's ``dflash_config.target_layer_ids``,
    so it has no default here (the caller passes the run's layers).
    """
    eagle3 = [1, num_layers // 2 - 1, num_layers - 4]
    if format == "specforge" and variant == "eagle3":
        return eagle3
    if format == "modelopt":
        return sorted({max(0, i) for i in eagle3})
    return []


def make_layout(
    format: Format,
    variant: str | None,
    held: list[int],
    num_layers: int | None,
    aux: list[int] | None,
) -> Layout:
    """The layout for a run holding hsx ids ``held`` of a model of ``num_layers``;
    ``aux`` in the trainer's ids (None: its default). ExportError, one line naming the
    missing layers in both numberings, when the run does not hold what it needs."""
    if aux is not None and format in ("speculators", "eagle"):
        raise ExportError(f"--aux-layers: the {format} layout takes no aux layers")
    if format == "speculators":
        return Layout(format, None, tuple(held), None, None)
    if num_layers is None:
        raise ExportError(f"{format}: the model's layer count is needed; pass --model")
    if aux is None:
        if format == "specforge" and variant == "dflash":
            aux = [i - 1 for i in held if 0 < i < num_layers]  # what the run holds
        else:
            aux = default_aux(format, variant, num_layers)
    bad = [i for i in aux if not 0 <= i <= num_layers - 2]
    if bad:
        raise ExportError(
            f"--aux-layers {bad}: out of range; the trainer's ids of aux layers run 0.."
            f"{num_layers - 2} for this model of {num_layers} layers"
        )
    if format == "specforge" and variant == "eagle3" and len(aux) != 3:
        raise ExportError(f"--aux-layers {aux}: SpecForge's EAGLE-3 takes exactly three")
    if not aux and format != "eagle":
        raise ExportError(f"{format}: no aux layers to export; pass --aux-layers")
    last = None if variant == "dflash" else num_layers
    layout = Layout(
        format, variant, tuple(i + 1 for i in aux), last, None if last is None else "after"
    )
    missing = [i for i in layout.needed() if i not in held]
    if missing:
        trainer = [i - 1 for i in missing]
        raise ExportError(
            f"{layout.name} needs hsx layer ids {missing} (the trainer's {trainer}; id "
            f"{num_layers} is the last layer), which the run does not hold (it holds "
            f"{held}); run it with --layers including them, or choose --aux-layers"
        )
    return layout


def convert(
    layout: Layout,
    states: torch.Tensor,
    held: list[int],
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    conversation_id: str,
    norm: FinalNorm | None,
) -> dict[str, Any]:
    """One object's tensors (``states`` [T, len(held), H]) as the layout's dict.

    ``norm`` is applied to the last layer when given (the caller decides from the
    objects' norm side and the layout's).
    """
    import torch

    column = {layer: j for j, layer in enumerate(held)}
    ids = token_ids.to(torch.int64).clone()
    mask = loss_mask.to(torch.int64).clone()
    aux = torch.cat([states[:, column[i]] for i in layout.aux], dim=-1) if layout.aux else None
    last = None
    if layout.last is not None:
        last = states[:, column[layout.last]]
        # A view keeps the whole [T, L, H] storage alive in torch.save: copy it out.
        last = norm(last) if norm is not None else last.clone()
    if layout.format == "specforge" and layout.variant == "dflash":
        return {"input_ids": ids, "loss_mask": mask, "hidden_states": aux}
    if layout.format == "specforge":
        assert last is not None
        assert aux is not None
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "hidden_state": last.unsqueeze(0),
            "aux_hidden_state": aux.unsqueeze(0),
        }
    if layout.format == "modelopt":
        assert last is not None
        assert aux is not None
        return {
            "input_ids": ids,
            "hidden_states": last,
            "aux_hidden_states": aux,
            "loss_mask": mask,
            "conversation_id": conversation_id,
            # ModelOpt's consumer re-applies the norm when True; ours is applied.
            "hidden_states_prenorm": False,
        }
    assert last is not None
    return {"input_ids": ids, "hidden_state": last, "loss_mask": mask}


def non_finite(tensors: dict[str, Any]) -> list[str]:
    """Names of the float tensors holding NaN or infinity."""
    import torch

    return [
        name
        for name, value in tensors.items()
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value).all())
    ]


def relative_path(layout: Layout, index: int, conversation_id: str, compress: bool) -> str:
    """Where sample ``index`` goes under DEST (see the module docstring)."""
    if layout.format == "specforge":
        group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
        name = f"rows_{group}-{group + SPECFORGE_GROUP}/data_{index}.ckpt"
        return f"{DATA_DIR}/{name}.gz" if compress else f"{DATA_DIR}/{name}"
    if layout.format == "modelopt":
        # ModelOpt names a file by its conversation id; an id that is not a plain file
        # name (a slash, a leading dot) is kept inside the file only.
        stem = conversation_id if _SAFE_NAME.fullmatch(conversation_id) else f"sample-{index}"
        return f"{DATA_DIR}/{stem}.pt"
    return f"{DATA_DIR}/data_{index}.ckpt"


def serialize(tensors: dict[str, Any], compress: bool) -> bytes:
    """``torch.save`` bytes (zip format, which ``torch.load(mmap=True)`` needs),
    gzipped when ``compress`` (level 6: most of 9's ratio at a fraction of its time)."""
    import torch

    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    data = buffer.getvalue()
    return gzip.compress(data, compresslevel=6) if compress else data
