"""Request helpers shared by the API modules."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError
from gateway.protocol.nesting import MAX_DEPTH, too_deep


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with a 413 as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body is larger than the limit of {limit} bytes.",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(request: Request, limit: int) -> Any:
    """Read at most ``limit`` bytes and decode them as JSON, with a 4xx for anything else."""
    return parse_json(await read_body(request, limit))


def parse_json(raw: bytes) -> Any:
    if not raw:
        raise APIError(400, "Request body is empty; expected a JSON object.", code="invalid_json")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):  # orjson reads at most 1,024 levels
            raise _too_deep("") from None
        raise APIError(400, f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
    where = too_deep(value)
    if where is not None:
        raise _too_deep(where)
    return value


def _too_deep(where: str) -> APIError:
    return APIError(400, f"The request's JSON{f' in {where!r}' if where else ''} is nested more than {MAX_DEPTH} "
                         "levels deep.", param=where or None, code="nesting_too_deep")


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON body encoded with orjson (several times faster than the standard library on large bodies)."""
    return Response(orjson.dumps(value), status_code=status, media_type="application/json", headers=headers)
