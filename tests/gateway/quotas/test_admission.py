"""Admission against limits, on this process's counters and on a real Redis: exact counts under a race, the hold
and its settlement, windows turning over with an injected clock."""

from __future__ import annotations

import asyncio
import calendar
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.quotas.admission import QuotaExceeded, Quotas, Rule, compile_rules
from gateway.quotas.counters import Counters, MemoryCounters, RedisCounters
from gateway.quotas.pricing import Pricing
from gateway.quotas.settings import Limits, LimitsSettings, Price
from gateway.quotas.windows import duration, window


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
async def counters(request: pytest.FixtureRequest) -> AsyncIterator[Counters]:
    if request.param == "memory":
        yield MemoryCounters()
        return
    shared = RedisCounters(request.getfixturevalue("redis_url"))
    yield shared
    await shared.aclose()


_RUN = iter(range(10**6))


def quotas(counters: Counters, clock: Clock | None = None, *, prices: dict[str, Price] | None = None,
           **limits: Any) -> tuple[Quotas, tuple[Rule, ...]]:
    """A ``Quotas`` and the rules of a key of its own (the Redis server is shared by the session's tests)."""
    q = Quotas(LimitsSettings(), counters, Pricing(prices or {}), clock=clock or Clock(1_800_000_000.0),
               default_completion_tokens=100)
    return q, compile_rules(f"key test-{next(_RUN)}", Limits(**limits))


async def test_a_race_for_ten_places_admits_exactly_ten(counters: Counters) -> None:
    q, scopes = quotas(counters, requests_per_minute=10)

    async def one() -> bool:
        try:
            await q.admit(scopes, "m", None, lambda: 0)
        except QuotaExceeded:
            return False
        return True

    outcomes = await asyncio.gather(*(one() for _ in range(100)))
    assert sum(outcomes) == 10
    # The refused added nothing: the count is the ten admitted, not a hundred.
    assert await counters.counts([f"{scopes[0].prefix}:m{int(q.clock()) // 60}"]) == [10]


async def test_concurrency_places_come_back_when_settled(counters: Counters) -> None:
    q, scopes = quotas(counters, max_concurrent=2)
    first = await q.admit(scopes, "m", None, lambda: 0)
    await q.admit(scopes, "m", None, lambda: 0)
    with pytest.raises(QuotaExceeded) as refused:
        await q.admit(scopes, "m", None, lambda: 0)
    assert refused.value.api_error().status_code == 429
    assert refused.value.api_error().code == "rate_limit_exceeded"
    await q.settle(first, 0, 0, None)
    await q.settle(first, 0, 0, None)  # settling twice frees one place, not two
    assert await q.admit(scopes, "m", None, lambda: 0) is not None
    with pytest.raises(QuotaExceeded):
        await q.admit(scopes, "m", None, lambda: 0)


async def test_tokens_are_held_capped_and_refunded(counters: Counters) -> None:
    q, scopes = quotas(counters, tokens_per_minute=1000)
    body: dict[str, Any] = {"max_tokens": 5000}
    hold = await q.admit(scopes, "m", body, lambda: 300)
    # The completion was capped to what the minute leaves after the prompt, and all of it is held.
    assert body["max_tokens"] == 700
    assert hold is not None and hold.tokens == 1000
    assert hold.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(QuotaExceeded):
        await q.admit(scopes, "m", {"max_tokens": 10}, lambda: 1)
    await q.settle(hold, 300, 50, None)  # spent 350: 650 come back
    again: dict[str, Any] = {"max_tokens": 5000}
    second = await q.admit(scopes, "m", again, lambda: 100)
    assert again["max_tokens"] == 550
    assert second is not None and second.headers["x-ratelimit-limit-tokens"] == "1000"


async def test_a_request_without_max_tokens_keeps_none_while_the_room_is_wide(counters: Counters) -> None:
    q, scopes = quotas(counters, tokens_per_day=10_000)
    body: dict[str, Any] = {}
    hold = await q.admit(scopes, "m", body, lambda: 50)
    assert "max_tokens" not in body and hold is not None and hold.tokens == 150  # prompt + the default hold
    await q.settle(hold, 50, 9_900, None)  # it spent more than held: the overrun is counted
    narrow: dict[str, Any] = {}
    with pytest.raises(QuotaExceeded) as refused:
        await q.admit(scopes, "m", narrow, lambda: 50)
    assert refused.value.budget and refused.value.api_error().code == "budget_exceeded"


async def test_a_day_budget_starts_again_when_the_utc_day_turns(counters: Counters) -> None:
    midnight = float(calendar.timegm((2026, 12, 31, 0, 0, 0)))
    clock = Clock(midnight - 30)  # 23:59:30 on Dec 30
    q, scopes = quotas(counters, clock, tokens_per_day=100, tokens_per_month=150)
    hold = await q.admit(scopes, "m", {"max_tokens": 60}, lambda: 40)
    await q.settle(hold, 40, 60, None)
    with pytest.raises(QuotaExceeded) as refused:
        await q.admit(scopes, "m", {"max_tokens": 1}, lambda: 1)
    assert refused.value.budget and refused.value.retry_after == pytest.approx(30)
    clock.now = midnight + 1  # Dec 31: a new day, the same month
    hold = await q.admit(scopes, "m", {"max_tokens": 100}, lambda: 10)
    assert hold is not None and hold.tokens == 50  # the month has 50 left, so the completion got 40
    await q.settle(hold, 10, 40, None)
    with pytest.raises(QuotaExceeded) as refused:
        await q.admit(scopes, "m", {"max_tokens": 1}, lambda: 1)
    assert refused.value.rule.label == "tokens per month"
    clock.now = midnight + 86400 + 1  # January: both start again
    assert await q.admit(scopes, "m", {"max_tokens": 1}, lambda: 1) is not None


async def test_money_budgets_count_at_the_price_table(counters: Counters) -> None:
    prices = {"m": Price(input=1.0, output=10.0)}  # a dollar per million in, ten out
    q, scopes = quotas(counters, prices=prices, usd_per_day=0.01)  # 10,000 millionths
    body: dict[str, Any] = {"max_tokens": 5000}
    hold = await q.admit(scopes, "m", body, lambda: 2000)
    # 2,000 prompt tokens cost 2,000 millionths; the 8,000 left buy 800 completion tokens.
    assert body["max_tokens"] == 800 and hold is not None and hold.micro_usd == 10_000
    await q.settle(hold, 2000, 100, 0.003)
    second: dict[str, Any] = {"max_tokens": 5000}
    await q.admit(scopes, "m", second, lambda: 1000)
    assert second["max_tokens"] == 600
    q2, unpriced_scopes = quotas(counters, prices=prices, usd_per_day=1.0)
    with pytest.raises(QuotaExceeded, match="has no price"):
        await q2.admit(unpriced_scopes, "other", {}, lambda: 1)


async def test_counters_down_let_requests_through() -> None:
    q, scopes = quotas(RedisCounters("redis://127.0.0.1:1/0"), requests_per_minute=1)
    assert await q.admit(scopes, "m", None, lambda: 0) is None
    assert await q.admit(scopes, "m", None, lambda: 0) is None


def test_windows_and_durations() -> None:
    t = float(calendar.timegm((2026, 12, 31, 23, 59, 30)))
    assert window("minute", t) == (f"m{int(t) // 60}", t + 30)
    assert window("day", t)[1] == t + 30
    assert window("month", t) == ("M202612", t + 30)
    assert [duration(s) for s in (0.02, 1, 59.2, 360, 3723)] == ["20ms", "1s", "1m0s", "6m0s", "1h2m3s"]
