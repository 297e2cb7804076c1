"""What a codec is (:class:`CodecImpl`), which ones there are (:data:`CODECS`), and the
metadata every object names them by.

Every codec writes a valid safetensors file with ``token_ids`` int64 [T] and string
``__metadata__`` naming the codec (``hsx.codec``), the format version
(``hsx.codec_version``) and the dtype the states decode to (``dtype``, the model's).
Each codec is one :class:`CodecImpl` subclass registered with ``@register`` (its class
docstring gives its layout); everything that names the codecs (the ``Codec`` type, the
settings, the API's schema, ``offered``) derives from :data:`CODECS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from service.codecs.safetensors_io import TensorEntry, corrupt

if TYPE_CHECKING:
    import torch

    #: A codec's name. At run time ``service.codecs.Codec`` is the Literal of the
    #: registered names, so pydantic fields of that type validate, document (the
    #: OpenAPI enum) and refuse by them.
    Codec = str

#: Version of the codec layouts; bumped when one of them changes. Readers read every
#: version up to theirs. 2: ``lossless``'s exponent plane is layer-major (1: token-major).
CODEC_VERSION = "2"
CODEC_KEY = "hsx.codec"
CODEC_VERSION_KEY = "hsx.codec_version"
#: The codec a decoded object was stored with (set by ``to_raw``).
DECODED_FROM_KEY = "hsx.decoded_from"
#: Metadata of an object that keeps some token positions only: the selection as JSON
#: (``"last"``, ``"mean"``, ``"mean_loss"`` or ``{"start": s, "end": e}``). Such an
#: object has a ``positions`` int64 tensor (the positions of ``token_ids`` kept, or for
#: a mean those averaged over) and ``hidden_states`` rows for them (one for a mean).
TOKENS_KEY = "hsx.tokens"
POOLED_SELECTIONS = frozenset({'"mean"', '"mean_loss"'})
#: Dtypes states decode to: the model dtypes hsx serves.
MODEL_DTYPES = ("float32", "bfloat16", "float16")

Shape = tuple[int, int, int]
"""[T, L, H]: tokens, layers, hidden size."""


def states_nbytes(shape: Shape, dtype: torch.dtype) -> int:
    """Bytes of states of ``shape`` in ``dtype`` (a model-dtype host copy)."""
    import torch

    tokens, layers, hidden = shape
    return tokens * layers * hidden * int(torch.empty((), dtype=dtype).element_size())


@dataclass(frozen=True)
class TensorCheck:
    """Checks the tensors of one object's header against what its codec writes."""

    codec: str
    tensors: Mapping[str, TensorEntry]

    def __call__(self, name: str, dtypes: Sequence[str], rank: int) -> tuple[int, ...]:
        """The shape of tensor ``name``: CorruptObjectError unless it is there, of one of
        ``dtypes`` (safetensors' names, the one the codec writes first) and ``rank``."""
        entry = self.tensors.get(name)
        if entry is None:
            raise corrupt(f"a {self.codec} object needs the tensor {name!r}")
        if entry.dtype not in dtypes or len(entry.shape) != rank:
            raise corrupt(
                f"{name} is {entry.dtype} {list(entry.shape)}; {self.codec} writes {dtypes[0]}"
            )
        return entry.shape


class CodecImpl(ABC):
    """One codec: the tensors it stores for the states, and the way back.

    A subclass names itself (``name``, the ``hsx.codec`` of its objects) and is
    registered with ``@register``; the package's public functions (``prepare``,
    ``pack_parts``, ``decode``, ...) dispatch to it. Only the states' tensors are the
    codec's: ``token_ids``, ``loss_mask`` and the metadata are written and checked
    alike for every codec.
    """

    name: ClassVar[str]
    #: A few words on what it stores, for settings and schema descriptions (``describe``).
    summary: ClassVar[str]
    #: The tensors it writes for the states (``decode`` returns every other as stored).
    tensor_names: ClassVar[frozenset[str]] = frozenset({"hidden_states"})
    #: Whether its objects must name the dtype they decode to (``raw`` objects from
    #: before the metadata named it need not).
    needs_dtype: ClassVar[bool] = True

    def offered_for(self, model_dtype: str) -> bool:
        """Whether a server of ``model_dtype`` offers it."""
        return True

    @abstractmethod
    def prepare(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stage one, on the states' device: the tensors to copy to the host."""

    @abstractmethod
    def prepared_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        """Host bytes of ``prepare``'s tensors for states of ``shape`` and ``dtype``."""

    def to_tensors(self, prepared: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage two, on the CPU: the contiguous tensors stored for ``prepare``'s."""
        return {name: t.contiguous() for name, t in prepared.items()}

    def restore(self, prepared: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The states ``prepare``'s tensors stand for, to validate them before storing."""
        return prepared["hidden_states"]

    @abstractmethod
    def check(self, tensor: TensorCheck, dtype: str | None) -> list[int]:
        """[T, L, H] of the states an object's header describes, each of the codec's
        tensors checked with ``tensor`` (CorruptObjectError otherwise). ``dtype`` is
        the object's model dtype (None only where ``needs_dtype`` is False)."""

    @abstractmethod
    def from_tensors(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, version: int
    ) -> torch.Tensor:
        """The states, in ``dtype``, of an object's (checked) tensors of codec ``version``."""


#: Every codec by name, in the order they are offered and listed.
CODECS: dict[str, CodecImpl] = {}

_C = TypeVar("_C", bound=type[CodecImpl])


def register(cls: _C) -> _C:
    """Class decorator: add an instance of ``cls`` to ``CODECS`` under ``cls.name``."""
    CODECS[cls.name] = cls()
    return cls


def codec_impl(codec: str) -> CodecImpl:
    """The registered codec ``codec``; ValueError naming the choices otherwise."""
    impl = CODECS.get(codec)
    if impl is None:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return impl


def describe() -> str:
    """Every codec with its summary, for descriptions: "`raw` (model dtype), ... or
    `lossless` (...)"."""
    named = [f"`{name}` ({impl.summary})" for name, impl in CODECS.items()]
    return ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else "".join(named)


def offered(model_dtype: str) -> list[Codec]:
    """The codecs a server of ``model_dtype`` offers (``bf16`` only downcasts float32)."""
    return [name for name, impl in CODECS.items() if impl.offered_for(model_dtype)]


def check_codec(codec: str, model_dtype: str) -> Codec:
    """``codec`` if a server of ``model_dtype`` offers it; ValueError naming the choices."""
    choices = offered(model_dtype)
    if codec not in choices:
        raise ValueError(
            f"codec {codec!r} is not offered for {model_dtype} states; "
            f"choose one of {', '.join(choices)}"
        )
    return codec
