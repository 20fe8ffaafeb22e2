"""What a call costs, from the ``[prices]`` table (US dollars per million tokens, by base model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.quotas.settings import Price
from replay import keys
from replay.records import CallRecord
from tools.settings import ConfigError

if TYPE_CHECKING:
    from replay.store import TrajectoryStore

MICRO = 1_000_000  # budgets in money are counted in millionths of a dollar: counters hold integers


class Pricing:
    def __init__(self, prices: dict[str, Price]) -> None:
        self.prices = prices

    def price(self, model: str | None) -> Price | None:
        return self.prices.get(model) if model else None

    def cost(self, model: str | None, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> float | None:
        """The call's cost in dollars; None when its model has no price."""
        price = self.price(model)
        if price is None:
            return None
        cached = min(max(cached_tokens, 0), prompt_tokens)
        cached_rate = price.input if price.cached_input is None else price.cached_input
        return ((prompt_tokens - cached) * price.input + cached * cached_rate
                + completion_tokens * price.output) / 1_000_000

    def cost_of_usage(self, model: str | None, usage: dict[str, Any] | None) -> float | None:
        """The cost of an answer's ``usage``: OpenAI's (``prompt_tokens_details.cached_tokens``) or Anthropic's
        (``input_tokens`` and the cache's reads and writes)."""
        usage = usage or {}
        if "input_tokens" in usage:
            cached = int(usage.get("cache_read_input_tokens") or 0)
            prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
            return self.cost(model, prompt, int(usage.get("output_tokens") or 0), cached)
        return self.cost(model, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                         _cached_tokens(usage))

    def price_record(self, record: CallRecord) -> float | None:
        """A recorded call's cost, kept on the record (priced once: the store keeps what it was given)."""
        if record.cost_usd is None:
            usage = (record.response or {}).get("usage")
            record.cost_usd = self.cost(record.base_model, record.prompt_tokens, record.completion_tokens,
                                        _cached_tokens(usage) if isinstance(usage, dict) else 0)
        return record.cost_usd


def _cached_tokens(usage: dict[str, Any]) -> int:
    """OpenAI's count of prompt tokens served from the upstream's cache."""
    details = usage.get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


async def check_key_budgets(store: TrajectoryStore, missing: list[str]) -> None:
    """A key's own budget in money needs a price for every model, as a configured one does: a ``ConfigError`` at
    start-up, naming the keys and the ``missing`` prices, rather than a budget that cannot be counted."""
    in_money = [row["id"] for row in await keys.list_keys(store)
                if row["revoked_at"] is None and row["limits"] and "usd_per" in row["limits"]]
    if in_money:
        raise ConfigError(f"keys {', '.join(in_money)} have budgets in money, but these models have no [prices] "
                          f"entry to count them with: {', '.join(missing)}")
