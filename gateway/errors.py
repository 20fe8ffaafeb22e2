"""Errors that leave the gateway in OpenAI's error envelope."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class APIError(Exception):
    """An error a client can act on; rendered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status_code: int, message: str, *, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def model_not_found(message: str) -> APIError:
    """OpenAI's answer to a model name nobody serves."""
    return APIError(404, message, param="model", code="model_not_found")


def store_unavailable(headers: dict[str, str] | None = None) -> APIError:
    """The store cannot be reached or written just now: nothing is answered that is not recorded, so nothing is
    answered; worth a retry."""
    return APIError(503, "The trajectory store is unavailable; try again shortly.", error_type="server_error",
                    code="store_unavailable", headers={**(headers or {}), "retry-after": "1"})


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: APIError) -> Response:
    return Response(orjson.dumps(exc.body()), status_code=exc.status_code,
                    media_type="application/json", headers=exc.headers)
