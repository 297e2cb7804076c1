"""Each prompt's fate, and a request's status when some prompts failed.

A request's prompts run concurrently; each ends as an :data:`Outcome`: its durable
object or the :class:`~service.engine.errors.ExtractionError` that stopped it. A request
with failed prompts takes its worst prompt's status and type, in the severity order of
``service.engine.errors.FAILURES``, and its answer lists every prompt's fate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from service.api.errors import ApiError
from service.api.schemas import ErrorDetail, PromptOutcome
from service.engine.errors import FAILURES, ExtractionError
from service.engine.wire import Extraction

log = logging.getLogger(__name__)

Outcome = Extraction | ExtractionError

#: Error types, most severe first, and the request status each implies.
_SEVERITY = [error.error_type for error in FAILURES]
_STATUS = {error.error_type: error.status for error in FAILURES}

#: Failure types whose detail stays in the server log, and what the client reads instead.
_PRIVATE = {
    "storage_error": "storage: the object could not be written",
    "storage_full": "storage: the store is full; delete objects that were read, then retry",
    "engine_unavailable": "the engine is not running",
    "internal_error": "internal error",
}


def as_outcome(result: Extraction | BaseException) -> Outcome:
    """A prompt task's result as an outcome: an error no ExtractionError names becomes
    one (``internal_error``), the original kept as its cause."""
    if isinstance(result, Extraction | ExtractionError):
        return result
    error = ExtractionError(str(result))
    error.__cause__ = result
    return error


def error_name(error: ExtractionError) -> str:
    """The class name of what failed the prompt (the original of an internal error)."""
    return type(error.__cause__ or error).__name__


def outcome_of(outcomes: Sequence[Outcome]) -> str:
    """The request's outcome label: ok, or the worst failure among its prompts."""
    errors = [o for o in outcomes if isinstance(o, ExtractionError)]
    return request_failure(errors)[1] if errors else "ok"


def request_failure(errors: Sequence[ExtractionError]) -> tuple[int, str]:
    """The status and type of a request some of whose prompts failed: its worst prompt's."""
    worst = min((e.error_type for e in errors), key=_SEVERITY.index)
    return _STATUS[worst], worst


def successes(outcomes: Sequence[Outcome]) -> list[Extraction]:
    """Every prompt's object; ApiError (4xx/5xx) listing every prompt's fate if any
    prompt failed."""
    errors = [o for o in outcomes if isinstance(o, ExtractionError)]
    if errors:
        raise _partial_failure(outcomes, errors)
    return [o for o in outcomes if isinstance(o, Extraction)]


def _partial_failure(outcomes: Sequence[Outcome], errors: list[ExtractionError]) -> ApiError:
    status, kind = request_failure(errors)
    per_prompt = [_prompt_outcome(i, o) for i, o in enumerate(outcomes)]
    failed = [p.index for p in per_prompt if p.error is not None]
    message = f"{len(failed)} of {len(outcomes)} prompts failed (indices {failed[:20]})"
    objects = [p.model_dump(exclude_none=True) for p in per_prompt]
    return ApiError(status, kind, message, index=failed[0], extra={"objects": objects})


def _prompt_outcome(index: int, outcome: Outcome) -> PromptOutcome:
    if isinstance(outcome, Extraction):
        return PromptOutcome(index=index, key=outcome.key)
    kind = outcome.error_type
    return PromptOutcome(index=index, error=ErrorDetail(type=kind, message=_message(kind, outcome)))


def _message(kind: str, error: ExtractionError) -> str:
    """What a client may read about a failed prompt: storage and internal details (paths,
    buckets, endpoints) go to the log only; the rest is about the prompt itself."""
    if kind not in _PRIVATE:
        return str(error) or kind
    log.warning("hsx: prompt failed (%s): %s", kind, error)
    return _PRIVATE[kind]
