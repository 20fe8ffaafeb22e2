"""Stitching: which trajectory a request extends, decided from hashes of its messages' prefixes.

``Stitcher`` serves a store only this process writes (SQLite). Its caches are refilled from the database on a
miss: a head hash -> the trajectory that had it (maybe no longer), a trajectory -> [its current head, next seq],
a session -> its newest trajectory. The look-ups are indexed point queries, run on the event loop itself
(microseconds, less than a hop to another thread and back).

``SharedStitcher`` serves a store other processes write too (PostgreSQL): no cache can be trusted there, so the
database decides. A request extends a trajectory by compare-and-swap on its head: the next sequence number is
claimed only while the head is still the one the request continues; when another process moved it on meanwhile,
the request forks, exactly as it would in one process.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from replay.records import CallRecord, TrajectoryRef, new_id

if TYPE_CHECKING:
    from replay.database import PostgresDatabase


class LRU(OrderedDict):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


class Stitcher:
    def __init__(self, capacity: int) -> None:
        self.lookup: sqlite3.Connection | None = None  # used only on the event loop; set when the store starts
        self._heads = LRU(capacity)
        self._state = LRU(capacity)
        self._sessions = LRU(capacity)
        self._lock = asyncio.Lock()

    async def stitch(self, *, session_key: str | None, prefix: list[str], anchor: str,
                      tenant: str | None, compacted: bool = False) -> TrajectoryRef:
        """Decide which trajectory a request extends, or start a new one (recording its parent).

        With a session key, the newest trajectory of that session is extended when the request's
        history starts with everything it holds, or when the history is ``compacted`` (the client
        shortened it, and the session goes on); otherwise the request forks it. Without one, the
        trajectory whose conversation is the longest prefix of the request is extended if that prefix
        is still its whole conversation, and forked if it has moved on since (an edit or a retry); a
        request that shares only the opening (system prompt and first user message) forks it too.
        """
        async with self._lock:
            scope = f"{tenant or ''}\x00"
            if session_key is not None:
                tid = self._sessions.get(scope + session_key) or self._session_from_db(session_key, tenant)
                if tid is not None:
                    state = self._state_of(tid)
                    if compacted or state[0] in set(prefix):
                        return self._claim(tid, state)
                return self._new(scope, session_key, parent=tid)
            cached = {h: t for h in prefix if (t := self._heads.get(scope + h)) is not None}
            stored = self._heads_from_db([h for h in prefix if h not in cached], tenant)
            for head in reversed(prefix):
                tid = cached.get(head) or stored.get(head)
                if tid is not None:
                    state = self._state_of(tid)
                    if state[0] == head:
                        return self._claim(tid, state)
                    return self._new(scope, f"prefix:{anchor}", parent=tid)
            anchor_key = f"prefix:{anchor}"
            parent = self._sessions.get(scope + anchor_key) or self._session_from_db(anchor_key, tenant)
            return self._new(scope, anchor_key, parent=parent)

    def advance(self, rec: CallRecord, head: str | None) -> None:
        """After a call, its conversation (request plus the first choice) is the trajectory's new head."""
        if head is None:
            return
        tid = rec.trajectory.id
        self._heads.put(f"{rec.tenant or ''}\x00" + head, tid)
        state = self._state.get(tid)
        if state is None:
            self._state.put(tid, [head, rec.trajectory.seq + 1])
        else:
            state[0] = head

    def forget(self) -> None:
        """After a delete the caches may name what is gone; they refill from the database on demand."""
        self._heads.clear()
        self._state.clear()
        self._sessions.clear()

    def _claim(self, tid: str, state: list[Any]) -> TrajectoryRef:
        # Reserve the sequence number now so concurrent calls on one trajectory never collide.
        seq = state[1]
        state[1] += 1
        return TrajectoryRef(id=tid, seq=seq, is_new=False)

    def _new(self, scope: str, session_key: str, parent: str | None) -> TrajectoryRef:
        ref = _new(session_key, parent)
        self._sessions.put(scope + session_key, ref.id)
        self._state.put(ref.id, [None, 1])
        return ref

    def _state_of(self, tid: str) -> list[Any]:
        """[current head hash, next call sequence number] of a trajectory."""
        state = self._state.get(tid)
        if state is None:
            row = self._point("SELECT head_hash, next_seq FROM trajectories WHERE id = ?", (tid,))
            state = [row[0], row[1]] if row else [None, 0]
            self._state.put(tid, state)
        return state

    def _point(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.lookup is not None
        return self.lookup.execute(sql, args).fetchone()

    def _session_from_db(self, session_key: str, tenant: str | None) -> str | None:
        row = self._point("SELECT id FROM trajectories WHERE session_key = ? AND tenant IS ? "
                          "ORDER BY updated_at DESC LIMIT 1", (session_key, tenant))
        return row[0] if row else None

    def _heads_from_db(self, heads: list[str], tenant: str | None) -> dict[str, str]:
        """Which of ``heads`` some trajectory has now: head → the newest such trajectory."""
        assert self.lookup is not None
        found: dict[str, str] = {}
        for i in range(0, len(heads), 500):
            chunk = heads[i:i + 500]
            marks = ",".join("?" * len(chunk))
            for head, tid in self.lookup.execute(
                    f"SELECT head_hash, id FROM trajectories WHERE head_hash IN ({marks}) AND tenant IS ? "
                    "ORDER BY updated_at", (*chunk, tenant)):
                found[head] = tid
        return found


_SESSION = ("SELECT id, head_hash FROM trajectories WHERE session_key = ? AND tenant IS ? "
            "ORDER BY updated_at DESC LIMIT 1")


class SharedStitcher:
    """The same decisions as ``Stitcher``, taken in the database (see the module doc)."""

    def __init__(self, db: PostgresDatabase) -> None:
        self.db = db

    async def stitch(self, *, session_key: str | None, prefix: list[str], anchor: str,
                     tenant: str | None, compacted: bool = False) -> TrajectoryRef:
        if session_key is not None:
            rows = await self.db.fetchall(_SESSION, (session_key, tenant))
            parent = rows[0]["id"] if rows else None
            if rows and (compacted or rows[0]["head_hash"] in set(prefix)):
                seq = await self._claim(parent, rows[0]["head_hash"])
                if seq is not None:
                    return TrajectoryRef(id=parent, seq=seq, is_new=False)
            return _new(session_key, parent)
        anchor_key = f"prefix:{anchor}"
        found: dict[str, str] = {}
        parent: str | None = None
        # One round trip for what a request almost always needs: the trajectories whose head its history holds,
        # and the newest one that shares its opening (the parent of a fork); longer histories take more.
        for i in range(0, len(prefix), 500):
            chunk = prefix[i:i + 500]
            for row in await self.db.fetchall(
                    f"(SELECT head_hash, id FROM trajectories WHERE head_hash IN ({','.join('?' * len(chunk))}) "
                    "AND tenant IS ? ORDER BY updated_at) "
                    + ("UNION ALL (SELECT NULL, id FROM trajectories WHERE session_key = ? AND tenant IS ? "
                       "ORDER BY updated_at DESC LIMIT 1)" if i == 0 else ""),
                    (*chunk, tenant, *((anchor_key, tenant) if i == 0 else ()))):
                if row["head_hash"] is None:
                    parent = row["id"]
                else:
                    found[row["head_hash"]] = row["id"]
        for head in reversed(prefix):
            tid = found.get(head)
            if tid is not None:
                seq = await self._claim(tid, head)
                if seq is not None:
                    return TrajectoryRef(id=tid, seq=seq, is_new=False)
                return _new(anchor_key, tid)
        return _new(anchor_key, parent)

    async def _claim(self, tid: str, head: str) -> int | None:
        """The next sequence number of ``tid``, if its head is still ``head``; None when it moved on."""
        rows = await self.db.fetchall(
            "UPDATE trajectories SET next_seq = next_seq + 1 WHERE id = ? AND head_hash = ? RETURNING next_seq - 1",
            (tid, head), relaxed=True)
        return rows[0][0] if rows else None

    def advance(self, rec: CallRecord, head: str | None) -> None:
        """The head moves in the database, with the call's commit."""

    def forget(self) -> None:
        """Nothing is cached."""


def _new(session_key: str, parent: str | None) -> TrajectoryRef:
    return TrajectoryRef(id=new_id(), seq=0, is_new=True, session_key=session_key, parent_id=parent)
