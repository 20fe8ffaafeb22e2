"""Admission against a caller's limits: counted before a call, settled after it.

A request is admitted only if every counter of every scope it falls in (its API key's, its tenant's) stays within
its limit once the request is added; otherwise it adds nothing and is refused (``Counters.take``: all or none,
atomic in memory and in Redis). So 100 requests racing for 10 places get exactly 10, however many replicas share
the counters.

Tokens are held before the call: the prompt plus the completion's ``max_tokens``, which is first capped to what the
tightest token or money limit leaves (``gateway/budget.py``'s ``cap_completion``, the mechanism that holds an agent
run's ``max_total_tokens``). After the call the hold is settled: the unused part is given back, an overrun added.
A request that sets no ``max_tokens`` is not given one (a huge one would be refused by servers that check it against
the context) unless the room left is smaller than ``default_completion_tokens``; it holds that many instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.budget import BudgetExhausted, cap_completion
from gateway.errors import APIError
from gateway.quotas.counters import Counters, CountersUnavailable, Give
from gateway.quotas.pricing import MICRO, Pricing
from gateway.quotas.settings import Limits, LimitsSettings
from gateway.quotas.windows import Span, duration, window

log = structlog.get_logger()

# Counters of a window outlive it a little, so a request settled just after the window turned finds its count.
_GRACE_SECONDS = 120
# A concurrency count has no window; it is dropped when untouched this long (what a crashed process held).
_CONCURRENCY_TTL = 3600.0

# (what a limit is called, its Limits field, what it counts, its window; None: in flight, no window)
_RULES: tuple[tuple[str, str, str, Span | None], ...] = (
    ("requests per minute", "requests_per_minute", "requests", "minute"),
    ("tokens per minute", "tokens_per_minute", "tokens", "minute"),
    ("tokens per day", "tokens_per_day", "tokens", "day"),
    ("tokens per month", "tokens_per_month", "tokens", "month"),
    ("dollars per day", "usd_per_day", "usd", "day"),
    ("dollars per month", "usd_per_month", "usd", "month"),
    ("concurrent requests", "max_concurrent", "concurrent", None),
)


@dataclass(frozen=True)
class Rule:
    """One limit of one scope: counted under ``prefix`` (and its window's name), up to ``limit`` (money in
    millionths of a dollar: counters hold integers)."""

    scope: str
    label: str
    measure: str
    span: Span | None
    limit: int
    prefix: str

    @property
    def budget(self) -> bool:
        return self.span in ("day", "month")


def compile_rules(scope: str, limits: Limits) -> tuple[Rule, ...]:
    rules = []
    for label, name, measure, span in _RULES:
        value = getattr(limits, name)
        if value is not None:
            limit = round(value * MICRO) if measure == "usd" else int(value)
            rules.append(Rule(scope, label, measure, span, limit, f"harness:{scope}:{name}"))
    return tuple(rules)


class QuotaExceeded(Exception):
    """A request past one of its scope's limits. ``budget`` when a day's or month's budget is spent (waiting a
    minute will not help), else a rate or concurrency limit."""

    def __init__(self, rule: Rule, retry_after: float, note: str = "") -> None:
        value = rule.limit / MICRO if rule.measure == "usd" else rule.limit
        wait = f" Please try again in {duration(retry_after)}." if retry_after > 0 else ""
        super().__init__(f"{'Budget' if rule.budget else 'Rate limit'} reached for {rule.scope} on {rule.label}"
                         f"{note}: limit {value:g}.{wait}")
        self.rule = rule
        self.retry_after = retry_after

    @property
    def budget(self) -> bool:
        return self.rule.budget

    def api_error(self) -> APIError:
        """OpenAI's 429: ``rate_limit_exceeded`` for a rate or concurrency limit, ``budget_exceeded`` (of type
        ``insufficient_quota``) for a spent budget; ``retry-after`` in whole seconds."""
        headers = {"retry-after": str(max(1, math.ceil(self.retry_after)))}
        if self.budget:
            return APIError(429, str(self), error_type="insufficient_quota", code="budget_exceeded", headers=headers)
        kind = "tokens" if self.rule.measure == "tokens" else "requests"
        return APIError(429, str(self), error_type=kind, code="rate_limit_exceeded", headers=headers)


@dataclass
class Hold:
    """What one admitted request added to its counters, until it is settled."""

    placed: _Placed
    tokens: int
    micro_usd: int
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


class _Windows:
    """The current window of each span, computed again only when it ends."""

    def __init__(self) -> None:
        self._current: dict[str, tuple[float, str, float]] = {}

    def get(self, span: Span | None, now: float) -> tuple[str, float]:
        if span is None:
            return "", math.inf
        cached = self._current.get(span)
        if cached is None or not cached[0] <= now < cached[2]:
            name, ends = window(span, now)
            start = ends - 60 if span == "minute" else now  # a day or month is re-checked from now on
            cached = self._current[span] = (start, name, ends)
        return cached[1], cached[2]


@dataclass
class _Placed:
    """A rule set's counter keys in the current windows, and until when they hold."""

    rules: tuple[Rule, ...]
    keys: list[str]
    ends: list[float]
    expiries: list[float]  # seconds a counter made now lives: its window's rest and a grace
    until: float
    counted: list[int]  # which rules count tokens or money
    # Per header family, the rules that may fill it: per-minute ones first (OpenAI's), then budgets.
    header_rules: dict[str, list[int]]


@dataclass
class Meter:
    """One caller's limits as an agent run's model calls meet them: each call held and settled on its own (a run
    holds no concurrency place: its request does, where it has one)."""

    quotas: Quotas
    rules: tuple[Rule, ...]
    model: str | None  # the base model, for its price

    async def admit(self, body: dict[str, Any], prompt_tokens: Callable[[], int]) -> Hold | None:
        return await self.quotas.admit(self.rules, self.model, body, prompt_tokens)

    async def settle(self, hold: Hold | None, usage: dict[str, Any] | None) -> None:
        usage = usage or {}
        await self.quotas.settle(hold, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                                 self.quotas.pricing.cost_of_usage(self.model, usage))


class Quotas:
    """The limits of every key and tenant, over one set of counters."""

    def __init__(self, settings: LimitsSettings, counters: Counters, pricing: Pricing, *,
                 clock: Callable[[], float] = time.time, default_completion_tokens: int = 4096) -> None:
        self.settings = settings
        self.counters = counters
        self.pricing = pricing
        self.clock = clock
        self.default_completion_tokens = default_completion_tokens
        self._windows = _Windows()
        self._callers: dict[tuple[str | None, str | None], tuple[Limits | None, tuple[Rule, ...]]] = {}
        self._placed: dict[int, _Placed] = {}
        self._down = False

    def rules(self, key_id: str | None, key_limits: Limits | None, tenant: str | None) -> tuple[Rule, ...]:
        """The rules a caller's requests count in; none for the admin key and an open gateway. Compiled once per
        caller, until its key's limits change (the authenticator hands out a new ``Limits`` object then)."""
        return self._compiled(key_id, key_limits, tenant)[1]

    def _compiled(self, key_id: str | None, key_limits: Limits | None,
                  tenant: str | None) -> tuple[Limits | None, tuple[Rule, ...], tuple[Rule, ...]]:
        """(the key's own limits it was compiled from, a request's rules, an agent run's call's rules: the same
        without the concurrency limits, as a run holds no place in flight)."""
        if key_id == "admin":
            key_id = None
        cached = self._callers.get((key_id, tenant))
        if cached is not None and cached[0] is key_limits:
            return cached
        rules: tuple[Rule, ...] = ()
        if key_id is not None:
            limits = key_limits.over(self.settings.key) if key_limits is not None else self.settings.key
            rules = compile_rules(f"key {key_id}", limits)
        if tenant is not None:
            rules += compile_rules(f"tenant {tenant}", self.settings.for_tenant(tenant))
        if len(self._callers) > 100_000:
            self._callers.clear()
        cached = self._callers[(key_id, tenant)] = (key_limits, rules, tuple(r for r in rules if r.span is not None))
        return cached

    def meter(self, key_id: str | None, key_limits: Limits | None, tenant: str | None,
              model: str | None) -> Meter | None:
        rules = self._compiled(key_id, key_limits, tenant)[2]
        return Meter(self, rules, model) if rules else None

    async def admit(self, rules: tuple[Rule, ...], model: str | None, body: dict[str, Any] | None,
                    prompt_tokens: Callable[[], int]) -> Hold | None:
        """Count one request in. ``body`` is a chat-shaped body whose completion limit may be capped (None for a
        call that generates nothing, such as embeddings); ``prompt_tokens`` is called only when a token or money
        limit needs it. Raises ``QuotaExceeded``.

        Shared counters that cannot be reached let the request through (logged once per outage): limits guard a fair
        share of the models, and refusing everyone while Redis is down would make its outage the gateway's."""
        if not rules:
            return None
        try:
            hold = await self._admit(rules, model, body, prompt_tokens)
        except CountersUnavailable as exc:
            self._unavailable(exc)
            return None
        self._down = False
        return hold

    async def _admit(self, rules: tuple[Rule, ...], model: str | None, body: dict[str, Any] | None,
                     prompt_tokens: Callable[[], int]) -> Hold:
        now = self.clock()
        placed = self._place(rules, now)
        keys, ends = placed.keys, placed.ends
        tokens = micro = 0
        if placed.counted:
            tokens, micro = await self._hold_tokens(rules, placed, model, body, prompt_tokens(), now)
        amounts = {"requests": 1, "concurrent": 1, "tokens": tokens, "usd": micro}
        refused, counts = await self.counters.take([
            (key, amounts[rule.measure], rule.limit, expiry)
            for rule, key, expiry in zip(rules, keys, placed.expiries, strict=True)])
        if refused is not None:
            raise QuotaExceeded(rules[refused], _retry(ends[refused], now))
        return Hold(placed, tokens, micro, _headers(placed, counts, now))

    def _place(self, rules: tuple[Rule, ...], now: float) -> _Placed:
        """Where ``rules`` count now: their counters' keys in the current windows, computed again only once the
        first of those windows has ended."""
        placed = self._placed.get(id(rules))
        if placed is not None and placed.rules is rules and now < placed.until:
            return placed
        keys, ends = [], []
        for rule in rules:
            name, end = self._windows.get(rule.span, now)
            keys.append(f"{rule.prefix}:{name}" if name else rule.prefix)
            ends.append(end)
        if len(self._placed) > 100_000:
            self._placed.clear()
        placed = self._placed[id(rules)] = _Placed(
            rules, keys, ends, [_expiry(end, now) for end in ends], min(ends),
            [i for i, r in enumerate(rules) if r.measure in ("tokens", "usd")],
            {measure: _header_order(rules, measure) for measure in ("requests", "tokens")})
        return placed

    async def _hold_tokens(self, rules: tuple[Rule, ...], placed: _Placed, model: str | None,
                           body: dict[str, Any] | None, prompt: int, now: float) -> tuple[int, int]:
        """The tokens and millionths of a dollar to hold, the completion capped to the tightest room left."""
        price = self.pricing.price(model)
        counted, ends = placed.counted, placed.ends
        counts = await self.counters.counts([placed.keys[i] for i in counted])
        room, binding = math.inf, counted[0]
        for i, count in zip(counted, counts, strict=True):
            rule, left = rules[i], rules[i].limit - count
            if rule.measure == "usd":
                if price is None:
                    raise QuotaExceeded(rule, 0, f" (the model {model!r} has no price)")
                # Money left, as tokens: the prompt at the input rate, the rest at the output rate (a price per
                # million tokens is millionths of a dollar per token, the counters' unit).
                after_prompt = left - prompt * price.input
                left = prompt - 1 if after_prompt < 0 else prompt + (
                    int(after_prompt // price.output) if price.output else 10**15)
            if left < room:
                room, binding = left, i
        completion = 0
        if body is not None:
            asked = body.get("max_completion_tokens") or body.get("max_tokens")
            if not asked and room - prompt >= self.default_completion_tokens:
                completion = self.default_completion_tokens
            else:
                try:
                    completion = cap_completion(body, remaining=int(min(room, 10**15)), prompt_tokens=prompt)
                except BudgetExhausted:
                    raise QuotaExceeded(rules[binding], _retry(ends[binding], now)) from None
        elif prompt > room:
            raise QuotaExceeded(rules[binding], _retry(ends[binding], now))
        micro = round(prompt * price.input + completion * price.output) if price is not None else 0
        return prompt + completion, micro

    async def settle(self, hold: Hold | None, prompt_tokens: int, completion_tokens: int,
                     cost_usd: float | None) -> None:
        """The request is over: its concurrency place is freed, and its tokens and cost made what they were."""
        if hold is None or hold.settled:
            return
        hold.settled = True
        spent = prompt_tokens + completion_tokens
        micro = round(cost_usd * MICRO) if cost_usd is not None else hold.micro_usd
        deltas = {"concurrent": -1, "tokens": spent - hold.tokens, "usd": micro - hold.micro_usd}
        await self._give(hold, deltas)

    async def _give(self, hold: Hold, deltas: dict[str, int]) -> None:
        placed = hold.placed
        items: list[Give] = [(key, deltas[rule.measure], expiry)
                             for rule, key, expiry in zip(placed.rules, placed.keys, placed.expiries, strict=True)
                             if deltas.get(rule.measure)]
        try:
            await self.counters.give(items)
        except CountersUnavailable as exc:
            self._unavailable(exc)

    def _unavailable(self, exc: Exception) -> None:
        if not self._down:
            log.warning("limits.counters_unavailable", error=str(exc))
        self._down = True


def _expiry(end: float, now: float) -> float:
    return _CONCURRENCY_TTL if end == math.inf else max(1.0, end - now + _GRACE_SECONDS)


def _retry(end: float, now: float) -> float:
    return 1.0 if end == math.inf else end - now


def _header_order(rules: tuple[Rule, ...], measure: str) -> list[int]:
    minute = [i for i, r in enumerate(rules) if r.measure == measure and r.span == "minute"]
    return minute or [i for i, r in enumerate(rules) if r.measure == measure]


def _headers(placed: _Placed, counts: list[int], now: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers: requests from the tightest requests-per-minute limit, tokens from the
    tightest tokens-per-minute limit, else the tightest token budget."""
    headers: dict[str, str] = {}
    rules = placed.rules
    for measure, candidates in placed.header_rules.items():
        if not candidates:
            continue
        i = min(candidates, key=lambda i: rules[i].limit - counts[i])
        headers[f"x-ratelimit-limit-{measure}"] = str(rules[i].limit)
        headers[f"x-ratelimit-remaining-{measure}"] = str(max(0, rules[i].limit - counts[i]))
        headers[f"x-ratelimit-reset-{measure}"] = duration(placed.ends[i] - now)
    return headers
