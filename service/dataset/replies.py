"""What an hsx error answer means for the prompts of a request."""

from __future__ import annotations

from service.client import HsxError


def error_text(error: HsxError) -> str:
    """``status type: message``, as manifests and warnings quote an answer."""
    return f"{error.status} {error.type}: {error.message}".strip()


def refusal_of(error: HsxError) -> tuple[str, str]:
    """(status, reason) of a prompt the server refused."""
    kind, message = error.type, error.message
    if kind == "limit_exceeded" and "max_model_len" in message:
        return "skipped", f"too_long: {message}"
    if error.status == 409:
        return "failed", f"conflict: {message}"
    if error.status == 413:
        return "failed", f"too_large: {message}"
    return "failed", f"refused: {error.status} {kind}: {message}"
