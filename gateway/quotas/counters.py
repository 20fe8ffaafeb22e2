"""Where limit counters live: this process's memory, or Redis (through the ``limits`` library's storage and its
connection pool), which every replica shares.

A request's counters are taken together or not at all: ``take`` adds each amount and, if any count would pass its
limit, adds none and says which. In Redis that is one Lua script, so it is atomic and one round trip however many
counters a request has, and replicas racing for the last unit cannot both get it. In memory it is plain Python with
no await inside, which the event loop cannot interleave.
"""

from __future__ import annotations

import time
from typing import Protocol

from limits.aio.storage import RedisStorage
from limits.errors import StorageError
from redis.asyncio import ConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

REDIS_TIMEOUT_SECONDS = 1.0

# A take: (key, amount, limit, seconds to live when the key is new)
Take = tuple[str, int, int, float]
# A give: (key, amount, seconds to live when the key is new); counts never go below zero
Give = tuple[str, int, float]


class CountersUnavailable(Exception):
    """The shared counters cannot be reached."""


class Counters(Protocol):
    async def take(self, items: list[Take]) -> tuple[int | None, list[int]]:
        """Add every amount, or none: the index of the first count that would pass its limit (None when all fit),
        and the counts after (none when refused)."""

    async def give(self, items: list[Give]) -> None: ...

    async def counts(self, keys: list[str]) -> list[int]: ...

    async def aclose(self) -> None: ...


class MemoryCounters:
    """One process's counters."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._expires: dict[str, float] = {}
        self._next_sweep = 0.0

    async def take(self, items: list[Take]) -> tuple[int | None, list[int]]:
        now = time.time()
        if now >= self._next_sweep:
            self._sweep(now)
        counts, expires = self._counts, self._expires
        after = []
        for i, (key, amount, limit, _) in enumerate(items):
            count = (counts.get(key, 0) if expires.get(key, 0.0) > now else 0) + amount
            if count > limit:
                return i, []
            after.append(count)
        for (key, _, _, expiry), count in zip(items, after, strict=True):
            if expires.get(key, 0.0) <= now:
                expires[key] = now + expiry
            counts[key] = count
        return None, after

    async def give(self, items: list[Give]) -> None:
        now = time.time()
        for key, amount, expiry in items:
            self._set(key, max(0, self._count(key, now) + amount), now, expiry)

    async def counts(self, keys: list[str]) -> list[int]:
        now = time.time()
        return [self._count(key, now) for key in keys]

    def _count(self, key: str, now: float) -> int:
        return self._counts.get(key, 0) if self._expires.get(key, 0.0) > now else 0

    def _set(self, key: str, count: int, now: float, expiry: float) -> None:
        if self._expires.get(key, 0.0) <= now:
            self._expires[key] = now + expiry
        self._counts[key] = count

    def _sweep(self, now: float) -> None:
        # Each window's counters are new keys: the old ones are dropped once a minute rather than one by one.
        for key in [k for k, until in self._expires.items() if until <= now]:
            del self._expires[key], self._counts[key]
        self._next_sweep = now + 60

    async def aclose(self) -> None:
        return None


# KEYS: the counters; ARGV: amount, limit and seconds to live of each, in turn.
_TAKE = """
for i, key in ipairs(KEYS) do
  if tonumber(redis.call('GET', key) or '0') + tonumber(ARGV[3 * i - 2]) > tonumber(ARGV[3 * i - 1]) then
    return {i, {}}
  end
end
local counts = {}
for i, key in ipairs(KEYS) do
  counts[i] = redis.call('INCRBY', key, ARGV[3 * i - 2])
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[3 * i]) end
end
return {0, counts}
"""
# KEYS: the counters; ARGV: amount and seconds to live of each.
_GIVE = """
for i, key in ipairs(KEYS) do
  if redis.call('INCRBY', key, ARGV[2 * i - 1]) < 0 then redis.call('SET', key, 0) end
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[2 * i]) end
end
return 0
"""


class RedisCounters:
    """Counters in Redis, shared by every replica pointed at it."""

    def __init__(self, url: str) -> None:
        # One immediate retry reconnects after a Redis restart; redis-py's default backoff would hold a request.
        self._pool = ConnectionPool.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                                             socket_timeout=REDIS_TIMEOUT_SECONDS, retry=Retry(NoBackoff(), 1))
        storage = RedisStorage("async+" + url, implementation="redispy", connection_pool=self._pool,
                               wrap_exceptions=True)
        self._redis = storage.bridge.get_connection()
        self._take = self._redis.register_script(_TAKE)
        self._give = self._redis.register_script(_GIVE)

    async def take(self, items: list[Take]) -> tuple[int | None, list[int]]:
        args = [x for _, amount, limit, expiry in items for x in (amount, limit, max(1, int(expiry)))]
        try:
            refused, counts = await self._take(keys=[key for key, _, _, _ in items], args=args)
        except (RedisError, StorageError, OSError) as exc:
            raise CountersUnavailable(str(exc)) from None
        return (int(refused) - 1, []) if refused else (None, [int(c) for c in counts])

    async def give(self, items: list[Give]) -> None:
        if not items:
            return
        args = [x for _, amount, expiry in items for x in (amount, max(1, int(expiry)))]
        try:
            await self._give(keys=[key for key, _, _ in items], args=args)
        except (RedisError, StorageError, OSError) as exc:
            raise CountersUnavailable(str(exc)) from None

    async def counts(self, keys: list[str]) -> list[int]:
        try:
            return [int(v or 0) for v in await self._redis.mget(keys)]
        except (RedisError, StorageError, OSError) as exc:
            raise CountersUnavailable(str(exc)) from None

    async def aclose(self) -> None:
        await self._pool.disconnect()


def open_counters(url: str) -> Counters:
    return MemoryCounters() if url == "memory://" else RedisCounters(url)
