"""What an hsx answer means for the prompts of a request."""

from __future__ import annotations

import json
from typing import Any

import httpx


def detail_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"message": response.text[:200]}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {"message": json.dumps(body)[:200]}


def error_of(response: httpx.Response) -> str:
    detail = detail_of(response)
    return f"{response.status_code} {detail.get('type', '')}: {detail.get('message', '')}".strip()


def outcome_of(status: int, detail: dict[str, Any]) -> tuple[str, str]:
    """(status, reason) of a prompt the server refused."""
    kind, message = detail.get("type", ""), detail.get("message", "")
    if kind == "limit_exceeded" and "max_model_len" in message:
        return "skipped", f"too_long: {message}"
    if status == 409:
        return "failed", f"conflict: {message}"
    if status == 413:
        return "failed", f"too_large: {message}"
    return "failed", f"refused: {status} {kind}: {message}"


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
