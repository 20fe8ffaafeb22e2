"""The trajectory store: SQLite (one file, the default) or PostgreSQL (shared by replicas), behind one interface.

Every write goes through one queue to one writer task, which commits whatever has gathered as one
transaction (SQLite: WAL, ``synchronous=NORMAL`` survives a process crash, ``FULL`` also a power loss;
PostgreSQL: a commit is durable when it returns). Callers await their record's commit, so a response is only
ever sent for an exchange that is already durable.

Which connections serve what is the database's affair (``replay.database``). Trajectories are read into the
read model (``replay.queries``); the other tables belong to small repositories beside it (``keys``, ``runs``,
``approvals``, ``bot_messages``, ``feedback``, ``stored_responses``), which alone use the store's private
``_select`` and ``_change``: SQL against this schema lives in ``replay/`` and nowhere else.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from replay import queries
from replay.database import Database, open_database
from replay.filters import Filters
from replay.model import Trajectory
from replay.records import CallRecord, Statement, TrajectoryRef, WriteOp
from replay.settings import StoreSettings
from replay.stitching import SharedStitcher, Stitcher
from replay.writer import Writer

# A writer trusts its cache of stored bodies this long on a shared store; the collector spares bodies stored or
# touched within twice that (``Writer.known_blobs``). A store only this process writes clears the cache instead.
SHARED_BLOB_TRUST_SECONDS = 600.0


class TrajectoryStore:
    def __init__(self, location: str, settings: StoreSettings | None = None, *,
                 on_commit: Callable[[int, float], None] | None = None,
                 cost_of: Callable[[CallRecord], float | None] | None = None) -> None:
        """The store at ``location`` (an SQLite file, or a ``postgresql://`` URL), run as ``settings`` say
        (``[store]``; its defaults without it: the location is named apart because commands open other stores
        than the configured one)."""
        s = settings or StoreSettings()
        self.location = location
        self._cost_of = cost_of  # a call's cost, priced as it is written
        self.db: Database = open_database(location, synchronous=s.synchronous, pool_size=s.pool_size)
        # The in-memory caches are bounded; a miss is an indexed look-up in the database, not a wrong answer.
        self._stitcher: Stitcher | SharedStitcher = (SharedStitcher(self.db) if self.db.shared  # type: ignore[arg-type]
                                                     else Stitcher(capacity=s.cache_entries))
        self._writer = Writer(db=self.db, advance=self._stitcher.advance, max_batch=s.max_batch,
                              max_queue=s.max_queue, commit_delay=s.commit_delay_ms / 1000, on_commit=on_commit,
                              known_blobs=2 * s.cache_entries,
                              trust_seconds=SHARED_BLOB_TRUST_SECONDS if self.db.shared else float("inf"))

    @property
    def shared(self) -> bool:
        """Whether other processes may write this store too (PostgreSQL)."""
        return self.db.shared

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.db.start()
        if isinstance(self._stitcher, Stitcher):
            self._stitcher.lookup = self.db.lookup  # type: ignore[union-attr]
        self._writer.start()

    async def close(self) -> None:
        """Commit everything already accepted, then close."""
        await self._writer.stop()
        await self.db.close()
        if isinstance(self._stitcher, Stitcher):
            self._stitcher.lookup = None

    @property
    def queue_depth(self) -> int:
        return self._writer.queue_depth

    # -- writing -----------------------------------------------------------------------------------

    async def stitch(self, *, session_key: str | None, prefix: list[str], anchor: str,
                      tenant: str | None, compacted: bool = False) -> TrajectoryRef:
        """Which trajectory a request extends, or a new one (see ``Stitcher.stitch``)."""
        return await self._stitcher.stitch(session_key=session_key, prefix=prefix, anchor=anchor, tenant=tenant,
                                           compacted=compacted)

    async def record(self, rec: CallRecord) -> None:
        """Queue a call for the next commit and wait until it is durable."""
        await self.write(WriteOp(records=[rec]))

    async def write(self, op: WriteOp) -> None:
        """Queue calls and statements to commit together, and wait until they are durable."""
        if self._cost_of is not None:
            for rec in op.records:
                if rec.cost_usd is None:
                    rec.cost_usd = self._cost_of(rec)
        await self._writer.write(op)

    # -- reading -----------------------------------------------------------------------------------

    async def list_trajectories(self, *, tenant: str | None = None, all_tenants: bool = False,
                                limit: int = 50, before: str | None = None,
                                filters: Filters | None = None) -> list[Trajectory]:
        """Newest first, without their calls; ``before`` an id, the page's keyset (ids sort by time)."""
        return await queries.listing(self.db, tenant=tenant, all_tenants=all_tenants, limit=limit, before=before,
                                     filters=filters)

    async def search(self, text: str, *, tenant: str | None = None, all_tenants: bool = False,
                     limit: int = 50, before: str | None = None,
                     filters: Filters | None = None) -> list[Trajectory]:
        """Trajectories whose messages hold every word of ``text`` (case folded), newest first, without their calls.
        SQLite searches an FTS5 index, PostgreSQL a ``tsvector`` one; words are matched whole, not as a query
        language (quotes, operators and punctuation are just text)."""
        words = re.findall(r"\w+", text)
        if not words:
            return []
        if self.db.dialect == "sqlite":
            # The ids are read from FTS5's own content table (``trajectory_text_content``: ``c1`` is
            # ``trajectory_id``) by the matches' rowids, not through the FTS table, which reads each match's row
            # with a statement of its own: three times slower for a word in most calls (bench/console.py).
            match = ("SELECT c1 FROM trajectory_text_content WHERE id IN "
                     "(SELECT rowid FROM trajectory_text WHERE trajectory_text MATCH ?)")
            query = " ".join(f'"{w}"' for w in words)
        else:
            match = "SELECT trajectory_id FROM trajectory_text WHERE document @@ plainto_tsquery('simple', ?)"
            query = " ".join(words)
        return await queries.listing(self.db, tenant=tenant, all_tenants=all_tenants, limit=limit, before=before,
                                     matching=(match, query), filters=filters)

    async def get_trajectory(self, trajectory_id: str, *, tenant: str | None = None,
                             all_tenants: bool = False) -> Trajectory | None:
        """A trajectory whole (the read model), or None when there is none the caller may see."""
        return await queries.trajectory(self.db, trajectory_id, tenant=tenant, all_tenants=all_tenants)

    async def select_ids(self, filters: Filters) -> list[str]:
        """Ids of the trajectories a ``replay.filters.Filters`` selects, oldest first."""
        where, args = filters.where("t")
        return [r["id"] for r in await self._select(f"SELECT t.id FROM trajectories t WHERE {where} ORDER BY t.id",
                                                    args)]

    async def integrity_check(self) -> list[str]:
        """SQLite's own check of the whole file: ``["ok"]``, or the problems it found. PostgreSQL checks its own
        pages as it reads them: there, only that the database answers."""
        if self.db.dialect != "sqlite":
            await self._select("SELECT 1")
            return ["ok"]
        try:
            return [next(iter(r.values())) for r in await self._select("PRAGMA integrity_check")]
        except sqlite3.DatabaseError as exc:  # damage the check cannot even walk past
            return [str(exc)]

    # -- deleting ----------------------------------------------------------------------------------

    async def delete(self, *, ids: list[str] | None = None, before: float | None = None) -> int:
        """Delete trajectories by id or age, then the bodies no remaining call refers to."""
        if ids is None and before is None:
            raise ValueError("delete needs ids or before")
        # Shielded like ``_change``: cancelling it half-way would leave the writer's transaction open.
        return await asyncio.shield(self._locked_delete(ids, before))

    async def _locked_delete(self, ids: list[str] | None, before: float | None) -> int:
        if ids is not None:
            which, args = f"id IN ({','.join('?' * len(ids))})", tuple(ids)
        else:
            which, args = "created_at < ?", (before,)
        async with self.db.write_lock:
            # The search index is an FTS5 table on SQLite, which knows no foreign keys: its rows go first, by hand.
            counts = await self.db.transaction(locked=True, statements=[
                (f"DELETE FROM trajectory_text WHERE trajectory_id IN (SELECT id FROM trajectories WHERE {which})",
                 args),
                (f"DELETE FROM trajectories WHERE {which}", args),
                *([(self._collect_blobs(), (time.time() - 2 * SHARED_BLOB_TRUST_SECONDS,))] if self.shared else [])])
            count = counts[1]
            if count and not self.shared:
                await self.db.transaction([(self._collect_blobs(), (float("inf"),))], locked=True)
                self._writer.known_blobs.clear()
                self._stitcher.forget()
            return count

    def _collect_blobs(self) -> str:
        """Bodies no call refers to, stored (or last touched by a writer) before ``?``."""
        each = ("json_each(model_calls.{0}) AS j" if self.db.dialect == "sqlite"
                else "jsonb_array_elements_text(model_calls.{0}::jsonb) AS j(value)")
        return f"""DELETE FROM blobs WHERE stored_at < ? AND hash NOT IN (
                       SELECT j.value FROM model_calls, {each.format('request_messages')}
                       UNION SELECT j.value FROM model_calls, {each.format('response_messages')}
                       UNION SELECT j.value FROM model_calls, {each.format('native_bodies')}
                       UNION SELECT tools_hash FROM model_calls WHERE tools_hash IS NOT NULL)"""

    # -- for the repositories in replay/ alone -------------------------------------------------------

    async def _select(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[dict[str, Any]]:
        return [dict(row) for row in await self.db.fetchall(sql, args)]

    async def _change(self, statements: list[Statement]) -> list[int]:
        """Statements committed together now, outside the writer's batches; the rows each changed. Shielded: a
        caller cancelled half-way must not leave a transaction open, which would lock every later write out."""
        return await asyncio.shield(self.db.transaction(statements))

    async def _change_returning(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        """One statement with a ``RETURNING`` clause, committed now: the rows it returned."""
        return (await asyncio.shield(self.db.transaction([(sql, args)], returning=True)))[0]
