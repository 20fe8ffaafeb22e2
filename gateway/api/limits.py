"""A request counted against its caller's limits (its key's and its tenant's) before it reaches a backend; the
hold is settled when its response is out (``gateway/context.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.agent.context import approximate_tokens
from gateway.auth import Principal
from gateway.backends.base import Backend
from gateway.context import RequestContext
from gateway.quotas.admission import QuotaExceeded


def prompt_counter(backend: Backend, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None) -> Callable[[], int]:
    """The prompt's tokens, by the backend's own tokenizer where it has one (the embedded model), else estimated."""
    count = getattr(backend, "count_tokens", None)
    return (lambda: count(messages, tools)) if callable(count) else (lambda: approximate_tokens(messages, tools))


async def admit(ctx: RequestContext, principal: Principal, model: str | None, body: dict[str, Any] | None,
                prompt_tokens: Callable[[], int]) -> None:
    """Hold the request's place within its caller's limits, capping ``body``'s completion to the room left; a 429
    when it does not fit."""
    quotas = ctx.gateway.quotas
    rules = quotas.rules(principal.key_id, principal.limits, principal.tenant)
    if not rules:
        return
    try:
        ctx.hold = await quotas.admit(rules, model, body, prompt_tokens)
    except QuotaExceeded as exc:
        ctx.line.status_detail = "budget_exceeded" if exc.budget else "rate_limited"
        raise exc.api_error() from None
