"""Why an extraction produced no object: the engine's errors, importable without vLLM.

The API process maps them to responses; keeping them here (no torch, no vLLM imports)
lets route modules import them without loading the engine. Each error carries the
error ``type`` and HTTP ``status`` a caller sees for the failed prompt.
"""

from __future__ import annotations

from typing import ClassVar


class ExtractionError(Exception):
    """An extraction did not produce an object."""

    error_type: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500


class StorageWriteError(ExtractionError):
    """The hidden states were computed but could not be written."""

    error_type = "storage_error"
    status = 502


class StorageFullError(StorageWriteError):
    """The store had no room for the object (an in-memory store at its capacity).

    Nothing was written; the request can be retried once readers delete what they read.
    """

    error_type = "storage_full"
    status = 507


class InvalidStatesError(ExtractionError):
    """The states were computed but failed validation (NaN/Inf, an all-zero layer).

    Nothing was stored. ``reason`` is ``non_finite`` or ``all_zero_layer``.
    """

    error_type = "invalid_hidden_states"
    status = 500

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineUnavailableError(ExtractionError):
    """The engine is dead or shutting down."""

    error_type = "engine_unavailable"
    status = 503


class InvalidPromptError(ExtractionError, ValueError):
    """The engine refused the prompt (too long, bad token ids)."""

    error_type = "invalid_request"
    status = 422


class IdempotencyConflictError(ExtractionError):
    """The object under a ``custom_id`` prompt's key was made by another request (other
    token ids, options or metadata), or cannot be read as an object; it is left as it is
    (``service.api.idempotency``)."""

    error_type = "conflict"
    status = 409


class CompletionChannelError(RuntimeError):
    """Start-up: the writing rank's messages do not reach the API (``engine.
    completion_address``); the engine was stopped. Not a per-prompt failure."""


#: Every per-prompt failure, most severe first (a request takes its worst prompt's).
FAILURES: tuple[type[ExtractionError], ...] = (
    EngineUnavailableError,
    StorageFullError,
    StorageWriteError,
    InvalidStatesError,
    ExtractionError,
    IdempotencyConflictError,
    InvalidPromptError,
)

#: Each failure class by its wire name (``WriteFailure.type``), so an error that crossed
#: a process boundary as a string becomes its class again without an if-chain.
ERROR_TYPES: dict[str, type[ExtractionError]] = {cls.error_type: cls for cls in FAILURES}
