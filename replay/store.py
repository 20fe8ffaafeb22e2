"""The trajectory store: SQLite, one writer task with group commit (``replay.writer``).

Every write goes through one queue to one writer task, which commits whatever has gathered as one
transaction (WAL; ``synchronous=NORMAL`` survives a process crash, ``FULL`` also a power loss). Callers
await their record's commit, so a response is only ever sent for an exchange that is already durable.

The store owns the connections, each for a reason: batches are written on the writer's thread; stitching's
point look-ups (``replay.stitching``) run on the event loop; everything else goes through aiosqlite, readers
beside the writer under WAL. Trajectories are read into the read model (``replay.queries``); the other tables
belong to small repositories beside it (``keys``, ``runs``, ``approvals``, ``bot_messages``, ``feedback``,
``stored_responses``), which alone use the store's private ``_select`` and ``_change``: SQL against this
schema lives in ``replay/`` and nowhere else.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from typing import Any

import aiosqlite

from replay import queries
from replay.model import Trajectory
from replay.records import CallRecord, Statement, TrajectoryRef, WriteOp
from replay.schema import migrate
from replay.settings import StoreSettings
from replay.stitching import Stitcher
from replay.writer import Writer


class TrajectoryStore:
    def __init__(self, path: str, settings: StoreSettings | None = None, *,
                 on_commit: Callable[[int, float], None] | None = None) -> None:
        """The store in the SQLite file ``path``, run as ``settings`` say (``[store]``; its defaults without it:
        the file is named apart because commands open other files than the configured one)."""
        s = settings or StoreSettings()
        self.path = path
        self.synchronous = s.synchronous
        # One transaction at a time on the store: batches, deletes and key changes.
        self._write_lock = asyncio.Lock()
        # The in-memory caches are bounded; a miss is an indexed look-up in the database, not a wrong answer.
        self._stitcher = Stitcher(capacity=s.cache_entries)
        self._writer = Writer(lock=self._write_lock, advance=self._stitcher.advance, max_batch=s.max_batch,
                              max_queue=s.max_queue, commit_delay=s.commit_delay_ms / 1000, on_commit=on_commit,
                              known_blobs=2 * s.cache_entries)
        self._write_conn: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._batch_conn: sqlite3.Connection | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        conn = sqlite3.connect(self.path)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            migrate(conn)
        finally:
            conn.close()
        self._write_conn = await self._connect()
        self._reader = await self._connect()
        self._batch_conn = self._connect_sync()
        self._stitcher.lookup = self._connect_sync()
        self._writer.start(self._batch_conn)

    async def _connect(self) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self.path)
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute(f"PRAGMA synchronous={self.synchronous}")
        await conn.execute("PRAGMA foreign_keys=ON")
        await conn.execute("PRAGMA busy_timeout=10000")
        conn.row_factory = aiosqlite.Row
        return conn

    def _connect_sync(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        for pragma in ("journal_mode=WAL", f"synchronous={self.synchronous}", "foreign_keys=ON",
                       "busy_timeout=10000"):
            conn.execute(f"PRAGMA {pragma}")
        return conn

    async def close(self) -> None:
        """Commit everything already accepted, then close."""
        await self._writer.stop()
        for conn in (self._write_conn, self._reader):
            if conn is not None:
                await conn.close()
        for sync_conn in (self._batch_conn, self._stitcher.lookup):
            if sync_conn is not None:
                sync_conn.close()
        self._write_conn = self._reader = self._batch_conn = self._stitcher.lookup = None

    @property
    def queue_depth(self) -> int:
        return self._writer.queue_depth

    # -- writing -----------------------------------------------------------------------------------

    async def stitch(self, *, session_key: str | None, prefix: list[str], anchor: str,
                      tenant: str | None) -> TrajectoryRef:
        """Which trajectory a request extends, or a new one (see ``Stitcher.stitch``)."""
        return await self._stitcher.stitch(session_key=session_key, prefix=prefix, anchor=anchor, tenant=tenant)

    async def record(self, rec: CallRecord) -> None:
        """Queue a call for the next commit and wait until it is durable."""
        await self.write(WriteOp(records=[rec]))

    async def write(self, op: WriteOp) -> None:
        """Queue calls and statements to commit together, and wait until they are durable."""
        await self._writer.write(op)

    # -- reading -----------------------------------------------------------------------------------

    async def list_trajectories(self, *, tenant: str | None = None, all_tenants: bool = False,
                                limit: int = 50, before: str | None = None) -> list[Trajectory]:
        """Newest first, without their calls."""
        assert self._reader is not None
        return await queries.listing(self._reader, tenant=tenant, all_tenants=all_tenants, limit=limit, before=before)

    async def get_trajectory(self, trajectory_id: str, *, tenant: str | None = None,
                             all_tenants: bool = False) -> Trajectory | None:
        """A trajectory whole (the read model), or None when there is none the caller may see."""
        assert self._reader is not None
        return await queries.trajectory(self._reader, trajectory_id, tenant=tenant, all_tenants=all_tenants)

    async def select_ids(self, filters: Any) -> list[str]:
        """Ids of the trajectories a ``replay.filters.Filters`` selects, oldest first."""
        where, args = filters.where("t")
        return [r["id"] for r in await self._select(f"SELECT t.id FROM trajectories t WHERE {where} ORDER BY t.id",
                                                    args)]

    async def integrity_check(self) -> list[str]:
        """SQLite's own check of the whole file: ``["ok"]``, or the problems it found."""
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
        assert self._write_conn is not None
        db = self._write_conn
        async with self._write_lock:
            if ids is not None:
                cur = await db.execute(f"DELETE FROM trajectories WHERE id IN ({','.join('?' * len(ids))})", ids)
            else:
                cur = await db.execute("DELETE FROM trajectories WHERE created_at < ?", (before,))
            count = cur.rowcount
            if count:
                await db.execute(
                    """DELETE FROM blobs WHERE hash NOT IN (
                           SELECT j.value FROM model_calls, json_each(model_calls.request_messages) AS j
                           UNION SELECT j.value FROM model_calls, json_each(model_calls.response_messages) AS j
                           UNION SELECT tools_hash FROM model_calls WHERE tools_hash IS NOT NULL)""")
            await db.commit()
            if count:
                self._writer.known_blobs.clear()
                self._stitcher.forget()
            return count

    # -- for the repositories in replay/ alone -------------------------------------------------------

    async def _select(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[dict[str, Any]]:
        assert self._reader is not None
        # one call on the connection's thread: see replay/queries.py on why a read must not be split
        return [dict(row) for row in await self._reader.execute_fetchall(sql, args)]

    async def _change(self, statements: list[Statement]) -> list[int]:
        """Statements committed together now, outside the writer's batches; the rows each changed. Shielded: a
        caller cancelled half-way must not leave a transaction open, which would lock every later write out."""
        return await asyncio.shield(self._transaction(statements))

    async def _change_returning(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        """One statement with a ``RETURNING`` clause, committed now: the rows it returned."""
        return (await asyncio.shield(self._transaction([(sql, args)], returning=True)))[0]

    async def _transaction(self, statements: list[Statement], *, returning: bool = False) -> list[Any]:
        assert self._write_conn is not None
        out: list[Any] = []
        async with self._write_lock:
            try:
                for sql, args in statements:
                    cur = await self._write_conn.execute(sql, args)
                    out.append([dict(row) for row in await cur.fetchall()] if returning else cur.rowcount)
                await self._write_conn.commit()
            except BaseException:
                await self._write_conn.rollback()
                raise
        return out
