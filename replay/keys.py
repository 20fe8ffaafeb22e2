"""API keys (stored as hashes of their secrets) and the nonces of signed requests."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from replay.records import new_id

if TYPE_CHECKING:
    from replay.store import TrajectoryStore

_PUBLIC = "id, tenant, name, capture, default_model, allow_model_override, limits"


async def create(store: TrajectoryStore, *, tenant: str, name: str | None, capture: bool, secret_hash: str,
                 default_model: str | None = None, allow_model_override: bool = False,
                 limits: dict[str, Any] | None = None) -> str:
    """A new key; ``limits`` are its own (JSON-able, the configured defaults apply where it sets none)."""
    key_id, now = new_id(), time.time()
    # In one commit with the key: from now on this store never serves an open gateway.
    await store._change([
        ("INSERT INTO api_keys(id, hash, tenant, name, capture, created_at, default_model, "
         "allow_model_override, limits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
         (key_id, secret_hash, tenant, name, int(capture), now, default_model, int(allow_model_override),
          json.dumps(limits) if limits else None)),
        ("INSERT INTO store_facts(name, value, set_at) VALUES ('keys_created', '1', ?) ON CONFLICT DO NOTHING",
         (now,))])
    return key_id


async def list_keys(store: TrajectoryStore) -> list[dict[str, Any]]:
    return await store._select(f"SELECT {_PUBLIC}, created_at, revoked_at FROM api_keys ORDER BY id")


async def find(store: TrajectoryStore, secret_hash: str) -> dict[str, Any] | None:
    """The live key with this secret's hash."""
    rows = await store._select(f"SELECT {_PUBLIC} FROM api_keys WHERE hash = ? AND revoked_at IS NULL",
                               (secret_hash,))
    return rows[0] if rows else None


async def update(store: TrajectoryStore, key_id: str, *, limits: dict[str, Any] | None = None,
                 clear_limits: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Set some of a live key's own limits (``limits``) and drop others (``clear_limits``, back to the configured
    defaults); the key as it now is, or None when there is no such live key."""
    # Read, then written: keys are changed by an operator's command, not by concurrent requests.
    rows = await store._select("SELECT limits FROM api_keys WHERE id = ? AND revoked_at IS NULL", (key_id,))
    if not rows:
        return None
    own = {k: v for k, v in {**json.loads(rows[0]["limits"] or "{}"), **(limits or {})}.items()
           if k not in clear_limits}
    await store._change([("UPDATE api_keys SET limits = ? WHERE id = ?", (json.dumps(own) if own else None, key_id))])
    return (await store._select(f"SELECT {_PUBLIC}, created_at, revoked_at FROM api_keys WHERE id = ?",
                                (key_id,)))[0]


async def own_limits(store: TrajectoryStore, key_id: str) -> dict[str, Any] | None:
    """A key's own limits (revoked keys' too: a run it started still counts against them)."""
    rows = await store._select("SELECT limits FROM api_keys WHERE id = ?", (key_id,))
    return json.loads(rows[0]["limits"]) if rows and rows[0]["limits"] else None


async def revoke(store: TrajectoryStore, key_id: str) -> bool:
    [changed] = await store._change([("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                      (time.time(), key_id))])
    return changed > 0


async def ever_created(store: TrajectoryStore) -> bool:
    """Whether an API key was ever created in this store (revoked ones count: the fact is never undone)."""
    return bool(await store._select("SELECT 1 FROM store_facts WHERE name = 'keys_created'"))


async def claim_nonce(store: TrajectoryStore, nonce: str, *, now: float, keep_seconds: float) -> bool:
    """Record a signed request's nonce; False when it was seen within ``keep_seconds`` (a replay). Older nonces
    are forgotten: their timestamps are outside any window a signature is accepted in."""
    counts = await store._change([("DELETE FROM bot_nonces WHERE seen_at < ?", (now - keep_seconds,)),
                                  ("INSERT INTO bot_nonces(nonce, seen_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                                   (nonce, now))])
    return counts[1] == 1
