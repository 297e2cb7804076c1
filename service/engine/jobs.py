"""The write path's values, each built once and never changed.

The scheduler half plans a :class:`PendingSave` (or a :class:`FailedSave`) when a
request finishes; the worker half copies the request's states out of the KV cache
into a :class:`CopyOut` and hands the writer pool a :class:`WriteJob` of the two.
Nothing here imports vLLM, so the writer and its tests need no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine.wire import WriteFailure

if TYPE_CHECKING:
    from service.codecs import Codec
    from service.masks import Span


@dataclass(frozen=True)
class PendingSave:
    """One finished request whose hidden states are to be copied out and written."""

    req_id: str
    key: str
    """The object's key."""
    token_ids: tuple[int, ...]
    """The tokens whose states are stored, in order."""
    block_ids: tuple[int, ...]
    """The request's blocks in the hidden-state cache group."""
    metadata: Mapping[str, str]
    """The object's ``__metadata__``, ours and the caller's (``objects.object_metadata``)."""
    layer_ids: tuple[int, ...] = ()
    """The layer ids stored, in order (validation names them; empty: positions)."""
    codec: Codec = "raw"
    """How the object stores its states (``service.codecs``)."""
    layer_index: tuple[int, ...] | None = None
    """Positions in the cache's layer dimension of the layers to store; None: all."""
    loss_spans: tuple[Span, ...] | None = None
    """Supervised ``[start, end)`` ranges of ``token_ids``: write a ``loss_mask``."""
    ttl_s: int | None = None
    """Seconds the object lives once published (``wire.RequestParams.ttl_s``)."""
    positions: tuple[int, ...] | None = None
    """The positions of ``token_ids`` whose states are copied (``wire.RequestParams.tokens``);
    None: all of them. Only these rows ever leave the cache."""
    pooled: bool = False
    """Store the mean of the ``positions``' states (one row) instead of the rows."""
    inline_bytes: int | None = None
    """Hand the object back in its completion instead of writing it, up to this many
    bytes (``wire.RequestParams.inline_bytes``); None: write it to storage."""

    @property
    def rows(self) -> int:
        """Rows of the stored ``hidden_states``: 1 when pooled, else the positions'."""
        if self.pooled:
            return 1
        return len(self.token_ids) if self.positions is None else len(self.positions)


@dataclass(frozen=True)
class FailedSave:
    """A finished request that gets no object: the worker reports ``failure`` under
    ``key`` without copying anything, and its blocks go back."""

    req_id: str
    key: str
    failure: WriteFailure


def _instant() -> float:
    return 0.0


def _copied() -> bool:
    return True


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class CopyOut:
    """One request's states in host memory, or on their way there.

    The defaults describe a synchronous copy: complete when made, nothing to give
    back. The callables hold no reference to ``tensors``, so once the writer has
    encoded them it can drop the host copy while it still has ``release`` to call.
    """

    tensors: Mapping[str, Any]
    """Host tensors: ``hidden_states`` [T, L, H] in the model dtype, or, when
    ``prepared``, the codec's device stage's tensors (``service.codecs.prepare``)."""
    prepared: bool = False
    """The codec's device stage already ran (CUDA)."""
    wait: Callable[[], float] = _instant
    """Blocks until the tensors are on the host; returns the copy's duration in seconds."""
    done: Callable[[], bool] = _copied
    """Whether the copy has completed, without blocking (its blocks can go back)."""
    release: Callable[[], None] = _nothing
    """Gives back what the copy holds (pinned buffers), once the object is written."""

    @property
    def states(self) -> Any:
        """The ``hidden_states`` tensor (the model's, or the codec's when ``prepared``)."""
        return self.tensors["hidden_states"]


@dataclass(frozen=True)
class WriteJob:
    """What the writer pool writes: a planned save and its copy-out."""

    save: PendingSave
    copy: CopyOut
    nbytes: int
    """Bytes reserved for it under the in-flight ceiling."""

    @property
    def key(self) -> str:
        """The object's key."""
        return self.save.key
