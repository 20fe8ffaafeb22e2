"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``, its type named by the status."""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def error_type_for(status: int) -> str:
    """The error type Anthropic gives a status; Claude Code retries ``overloaded_error`` and ``rate_limit_error``."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type or error_type_for(status), "message": message}}
