"""The web console's sign-in sessions: a row per session, found by the hash of its cookie's token.

A session is live while it has not expired, was not signed out, and the key it was signed in with still stands:
an API key not revoked (read with the session, so a revocation ends it at the next page), the admin key unchanged
(its hash is kept), or, for a session of an open gateway, the gateway still open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replay.store import TrajectoryStore


async def create(store: TrajectoryStore, *, session_hash: str, key_id: str | None, key_hash: str | None,
                 tenant: str | None, admin: bool, csrf: str, now: float, expires_at: float) -> None:
    # Expired sessions go in the same commit: the table holds at most a lifetime's sign-ins.
    await store._change([
        ("DELETE FROM console_sessions WHERE expires_at <= ?", (now,)),
        ("INSERT INTO console_sessions(id, key_id, key_hash, tenant, admin, csrf, created_at, expires_at) "
         "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (session_hash, key_id, key_hash, tenant, int(admin), csrf, now,
                                             expires_at))])


async def find(store: TrajectoryStore, session_hash: str, now: float) -> dict[str, Any] | None:
    """The unexpired session with this hash, with whether its API key (if it has one) is still live."""
    rows = await store._select(
        "SELECT s.key_id, s.key_hash, s.tenant, s.admin, s.csrf, s.expires_at, "
        "k.id IS NOT NULL AND k.revoked_at IS NULL AS key_live, k.name AS key_name "
        "FROM console_sessions s LEFT JOIN api_keys k ON k.id = s.key_id "
        "WHERE s.id = ? AND s.expires_at > ?", (session_hash, now))
    return rows[0] if rows else None


async def delete(store: TrajectoryStore, session_hash: str) -> None:
    await store._change([("DELETE FROM console_sessions WHERE id = ?", (session_hash,))])
