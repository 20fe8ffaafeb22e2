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
from starlette.types import Receive, Scope, Send

from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.quotas.admission import Hold

_LINE = "access_line"


@dataclass
class AccessLine:
    """The fields of one request's access-log line; None ones are left out of it."""

    model: str | None = None  # the served name the request was routed to (or an agent profile's)
    backend: str | None = None
    adapter: str | None = None
    canary: str | None = None
    fallback_from: str | None = None  # the model whose call failed before the one that answered
    stream: bool | None = None
    trajectory_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None  # at [prices]; None when no call had a price
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
    hold: Hold | None = None  # what the request holds of its caller's limits until its response is out

    async def settle(self) -> None:
        """Give back what the request held beyond what it spent (tokens and cost as its calls were accounted)."""
        if self.hold is not None:
            line = self.line
            await self.gateway.quotas.settle(self.hold, line.prompt_tokens or 0, line.completion_tokens or 0,
                                             line.cost_usd)


Handler = Callable[[RequestContext], Awaitable[Response]]


class _SettledAfter:
    """A response, and the request's limits settled once it is out (a stream's last byte sent, or its client gone)."""

    def __init__(self, response: Response, ctx: RequestContext) -> None:
        self.response = response
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            await self.ctx.settle()


def endpoint(gateway: Gateway, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint that serves ``handler`` with the request's context. A request admitted against its
    caller's limits answers with their ``x-ratelimit-*`` headers, errors included, and is settled at its end."""

    @wraps(handler)
    async def serve(request: Request) -> Response:
        ctx = RequestContext(gateway, request, access_line(request.scope))
        try:
            response = await handler(ctx)
        except BaseException as exc:
            if ctx.hold is not None:
                if isinstance(exc, APIError):
                    exc.headers = {**ctx.hold.headers, **(exc.headers or {})}
                await ctx.settle()
            raise
        if ctx.hold is None:
            return response
        response.headers.update(ctx.hold.headers)
        return _SettledAfter(response, ctx)  # type: ignore[return-value]

    return serve
