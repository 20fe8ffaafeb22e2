"""A request's context, passed explicitly from its route down: the gateway serving it, the request, and its access-log
line as typed fields.

``AccessLog`` (gateway/app.py) opens the line when a request comes in and writes it, with the request metrics, when
the response is out; ``endpoint`` hands each route its ``RequestContext``. Everything a handler learns on the way
(where the request was routed, its trajectory, its tokens) goes on the line, field by field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import wraps
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

if TYPE_CHECKING:
    from gateway.app import Gateway

_LINE = "access_line"


@dataclass
class AccessLine:
    """The fields of one request's access-log line; None ones are left out of it."""

    model: str | None = None  # the served name the request was routed to (or an agent profile's)
    backend: str | None = None
    adapter: str | None = None
    canary: str | None = None
    stream: bool | None = None
    trajectory_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    invalid_tool_calls: int | None = None
    status_detail: str | None = None  # e.g. client_disconnected
    error: str | None = None  # the error code or type answered
    side_request: str | None = None  # Messages API: a client's side request, by purpose
    dropped: list[str] | None = None  # what a chat backend could not take
    dropped_tools: list[str | None] | None = None
    agent_status: str | None = None
    termination_reason: str | None = None
    bot_message: str | None = None
    conversation_id: str | None = None

    def fields(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items() if value is not None}


def open_line(scope: Scope) -> AccessLine:
    """A new request's line, kept in its scope for the whole exchange."""
    line = AccessLine()
    scope.setdefault("state", {})[_LINE] = line
    return line


def access_line(scope: Scope) -> AccessLine:
    """The request's line (a throwaway one outside ``AccessLog``, e.g. in a bare test app)."""
    state = scope.setdefault("state", {})
    line = state.get(_LINE)
    if line is None:
        line = state[_LINE] = AccessLine()
    return line


@dataclass
class RequestContext:
    gateway: Gateway
    request: Request
    line: AccessLine
    requested_model: str | None = None  # the model as the client named it, before aliases


Handler = Callable[[RequestContext], Awaitable[Response]]


def endpoint(gateway: Gateway, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint that serves ``handler`` with the request's context."""

    @wraps(handler)
    async def serve(request: Request) -> Response:
        return await handler(RequestContext(gateway, request, access_line(request.scope)))

    return serve
