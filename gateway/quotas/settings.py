"""``[limits]`` (rates, concurrency and budgets per key and per tenant) and ``[prices]`` (what a model's tokens
cost)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Protocol
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from tools.settings import Section


def check_counter_storage(value: str) -> str:
    """``memory://`` or a Redis URL; checked at load so that a typo stops the start, not the first request. The value
    is not echoed: a Redis URL may carry a password."""
    if value == "memory://":
        return value
    url = urlsplit(value)
    try:
        url.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ValueError("the Redis URL's port must be a number") from None
    if url.scheme not in ("redis", "rediss") or not url.hostname:
        raise ValueError("must be memory:// or a Redis URL such as redis://127.0.0.1:6379/0 (rediss:// for TLS)")
    database = url.path.strip("/")
    if database and not database.isdigit():
        raise ValueError("the Redis URL's path must be a database number, as in redis://host:6379/0")
    return value


# memory:// or a Redis URL, checked at load.
CounterStorage = Annotated[str, AfterValidator(check_counter_storage)]


class Limits(Section):
    """One scope's limits (an API key's or a tenant's); a limit left out is no limit."""

    requests_per_minute: int | None = Field(None, ge=1, description="Requests per minute (UTC clock minutes).")
    tokens_per_minute: int | None = Field(None, ge=1, description="Prompt plus completion tokens per minute.")
    max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once.")
    tokens_per_day: int | None = Field(None, ge=1, description="Prompt plus completion tokens per UTC day.")
    tokens_per_month: int | None = Field(None, ge=1, description="Prompt plus completion tokens per UTC month.")
    usd_per_day: float | None = Field(None, gt=0, description="Spend per UTC day, in US dollars, at [prices].")
    usd_per_month: float | None = Field(None, gt=0, description="Spend per UTC month, in US dollars, at [prices].")

    def over(self, below: Limits) -> Limits:
        """These limits, with ``below``'s where these set none."""
        return below.model_copy(update=self.model_dump(exclude_none=True))

    @property
    def in_money(self) -> bool:
        return self.usd_per_day is not None or self.usd_per_month is not None


class LimitsSettings(Section):
    storage: CounterStorage = Field("memory://", description="Where the counters live: memory:// (this process "
                                    "alone) or a redis://host:port/db URL that replicas share.")
    key: Limits = Field(default_factory=Limits, description="[limits.key]: every API key's limits, unless the key "
                        "has its own (harness keys create/update).")
    tenant: Limits = Field(default_factory=Limits, description="[limits.tenant]: every tenant's limits, over all of "
                           "its keys and its bot conversations together.")
    tenants: dict[str, Limits] = Field(default_factory=dict, description="[limits.tenants.NAME]: one tenant's "
                                       "limits, over [limits.tenant] field by field.")

    def for_tenant(self, tenant: str) -> Limits:
        own = self.tenants.get(tenant)
        return own.over(self.tenant) if own is not None else self.tenant

    @property
    def in_money(self) -> bool:
        return self.key.in_money or self.tenant.in_money or any(t.in_money for t in self.tenants.values())


class Price(Section):
    """US dollars per million tokens."""

    input: float = Field(ge=0, description="Per million prompt tokens.")
    cached_input: float | None = Field(None, ge=0, description="Per million prompt tokens served from the "
                                       "upstream's cache (default: input).")
    output: float = Field(ge=0, description="Per million completion tokens.")


class _Serving(Protocol):
    models: list[str]


def unpriced(backends: Iterable[_Serving], prices: dict[str, Price]) -> list[str]:
    """The models the backends serve that a money budget could not be counted on."""
    return sorted({m for b in backends for m in b.models if m not in prices})
