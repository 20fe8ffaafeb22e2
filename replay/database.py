"""The two databases a store runs on, and what differs between them: SQLite (the default, one file, one
process) and PostgreSQL (one database that gateway replicas and worker processes share).

Repositories write their SQL once, in SQLite's spelling: ``?`` placeholders, ``x IS ?`` for a comparison that
treats NULL as a value. ``for_postgres`` rewrites such a statement for PostgreSQL (pure, cached per statement);
everything else they write is SQL both databases read alike (``ON CONFLICT``, ``RETURNING``). Where the two
really differ (the schema's types, JSON functions, full-text search) the repository names both.

Both classes offer the store the same few operations: ``fetchall`` (a read, rows addressable by position and by
column name), ``transaction`` (statements committed together now) and ``commit_steps`` (the writer's batch, on
the writer's thread). Which connections serve them is each database's own affair.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiosqlite
import structlog

from replay.records import Statement
from replay.schema import migrate, migrate_postgres

log = structlog.get_logger()

POSTGRES_SCHEMES = ("postgresql://", "postgres://")

# How long a request waits for a connection to PostgreSQL (a free one in the pool, or a new one) before it is
# answered 503: a server that is down or unreachable must not hold requests for long.
WAIT_SECONDS = 5

# (sql, rows): ``executemany`` of one statement over rows, inside the writer's transaction.
Step = tuple[str, Sequence[Sequence[Any]]]


def is_postgres(location: str) -> bool:
    return location.startswith(POSTGRES_SCHEMES)


_NULL_SAFE = re.compile(r"\bIS(\s+NOT)?\s+\?")


@functools.lru_cache(maxsize=2048)
def for_postgres(sql: str) -> str:
    """A statement in the repositories' spelling, as PostgreSQL reads it: ``?`` becomes ``%s`` (and a literal ``%``
    is doubled), ``IS ?`` becomes ``IS NOT DISTINCT FROM %s`` and ``IS NOT ?`` ``IS DISTINCT FROM %s``."""
    sql = _NULL_SAFE.sub(lambda m: "IS DISTINCT FROM ?" if m.group(1) else "IS NOT DISTINCT FROM ?", sql)
    out: list[str] = []
    quoted = False
    for ch in sql:
        if ch == "'":
            quoted = not quoted
            out.append(ch)
        elif ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)


class StoreUnavailable(RuntimeError):
    """The database cannot be reached (or cannot write at all) just now: every request would fail alike."""


class Row(tuple):
    """A result row read by position or by column name, as ``sqlite3.Row`` is; ``dict(row)`` names its columns."""

    __slots__ = ()
    _index: dict[str, int] = {}

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


@functools.lru_cache(maxsize=512)
def _row_class(names: tuple[str, ...]) -> type[Row]:
    return type("Row", (Row,), {"__slots__": (), "_index": {n: i for i, n in enumerate(names)}})


def keyed_rows(cursor: Any) -> Callable[[Sequence[Any]], Row]:
    """psycopg's row factory for ``Row``s."""
    cls = _row_class(tuple(c.name for c in cursor.description or ()))
    return cls


class _NoLock(AbstractAsyncContextManager[None]):
    """Nothing to wait for: PostgreSQL orders concurrent transactions itself, or the caller holds the lock."""

    async def __aexit__(self, *exc: object) -> None:
        return None


# SQLite's primary result codes that speak of the database, not of a row: busy, locked, out of memory, read-only,
# I/O error, corrupt, full, cannot open, not a database. Every write fails with these; none is to blame.
_SQLITE_STORE_FAILURES = frozenset({5, 6, 7, 8, 10, 11, 13, 14, 26})


class SQLiteDatabase:
    """One file in WAL mode. Writes are one at a time (``write_lock``), reads beside them."""

    dialect = "sqlite"
    shared = False  # one process: workers and replicas are refused

    def __init__(self, path: str, *, synchronous: str) -> None:
        self.path = path
        self.synchronous = synchronous
        self.write_lock: AbstractAsyncContextManager[Any] = asyncio.Lock()
        self._write_conn: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._batch_conn: sqlite3.Connection | None = None
        self.lookup: sqlite3.Connection | None = None  # stitching's point reads, on the event loop

    async def start(self) -> None:
        conn = sqlite3.connect(self.path)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            migrate(conn)
        finally:
            conn.close()
        self._write_conn = await self._connect()
        self._reader = await self._connect()
        self._batch_conn = self.connect_sync()
        self.lookup = self.connect_sync()

    async def _connect(self) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self.path)
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute(f"PRAGMA synchronous={self.synchronous}")
        await conn.execute("PRAGMA foreign_keys=ON")
        await conn.execute("PRAGMA busy_timeout=10000")
        conn.row_factory = aiosqlite.Row
        return conn

    def connect_sync(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        for pragma in ("journal_mode=WAL", f"synchronous={self.synchronous}", "foreign_keys=ON",
                       "busy_timeout=10000"):
            conn.execute(f"PRAGMA {pragma}")
        return conn

    async def close(self) -> None:
        for conn in (self._write_conn, self._reader):
            if conn is not None:
                await conn.close()
        for sync_conn in (self._batch_conn, self.lookup):
            if sync_conn is not None:
                sync_conn.close()
        self._write_conn = self._reader = self._batch_conn = self.lookup = None

    async def fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        assert self._reader is not None
        # One call on the connection's thread (execute_fetchall), never an execute and a fetch queued apart: a
        # request's statement must not join another's unfinished read, whose WAL snapshot predates commits since.
        return list(await self._reader.execute_fetchall(sql, args))

    async def transaction(self, statements: list[Statement], *, returning: bool = False,
                          locked: bool = False) -> list[Any]:
        """``locked``: the caller holds ``write_lock`` already."""
        assert self._write_conn is not None
        out: list[Any] = []
        async with _NoLock() if locked else self.write_lock:
            try:
                for sql, args in statements:
                    cur = await self._write_conn.execute(sql, args)
                    out.append([dict(row) for row in await cur.fetchall()] if returning else cur.rowcount)
                await self._write_conn.commit()
            except BaseException:
                await self._write_conn.rollback()
                raise
        return out

    def commit_steps(self, steps: list[Step], statements: list[Statement], delay: float) -> None:
        """One transaction on the writer's thread; all of it or none of it."""
        db = self._batch_conn
        assert db is not None
        db.execute("BEGIN")
        try:
            for sql, rows in steps:
                if rows:
                    db.executemany(sql, rows)
            for sql, args in statements:
                db.execute(sql, args)
            if delay:
                time.sleep(delay)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @staticmethod
    def whole_store(exc: BaseException) -> bool:
        """Whether a failed write failed for the database's sake (every write would), not for its own rows."""
        return isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _SQLITE_STORE_FAILURES


class PostgresDatabase:
    """One PostgreSQL database. Reads and short transactions go through a pool of autocommit connections on the
    event loop; the writer's batches through one connection of their own on the writer's thread, opened again
    when the server dropped it."""

    dialect = "postgresql"
    shared = True

    def __init__(self, url: str, *, pool_size: int) -> None:
        self.url = url
        self.pool_size = pool_size
        self.write_lock: AbstractAsyncContextManager[Any] = _NoLock()
        self._pool: Any = None
        self._relaxed: Any = None
        self._batch_conn: Any = None

    async def start(self) -> None:
        import psycopg
        from psycopg_pool import AsyncConnectionPool

        await asyncio.to_thread(self._migrate)
        self._pool = AsyncConnectionPool(self.url, min_size=1, max_size=self.pool_size, open=False,
                                         timeout=WAIT_SECONDS, kwargs={"autocommit": True, "row_factory": keyed_rows},
                                         name="harness-store")
        self._relaxed = AsyncConnectionPool(self.url, min_size=1, max_size=2, open=False, timeout=WAIT_SECONDS,
                                            kwargs={"autocommit": True, "row_factory": keyed_rows,
                                                    "options": "-c synchronous_commit=off"},
                                            name="harness-store-relaxed")
        try:
            await self._pool.open(wait=True, timeout=30)
            await self._relaxed.open(wait=True, timeout=30)
        except psycopg.Error as exc:
            raise RuntimeError(f"cannot connect to the store at {redact_url(self.url)}: {exc}") from None
        self._batch_conn = await asyncio.to_thread(self.connect_sync)

    def _migrate(self) -> None:
        with self.connect_sync() as conn:
            migrate_postgres(conn)

    def connect_sync(self) -> Any:
        return connect_postgres(self.url)

    async def close(self) -> None:
        for pool in (self._pool, self._relaxed):
            if pool is not None:
                await pool.close()
        if self._batch_conn is not None:
            await asyncio.to_thread(self._batch_conn.close)
        self._pool = self._relaxed = self._batch_conn = None

    async def fetchall(self, sql: str, args: Sequence[Any] = (), *, relaxed: bool = False) -> list[Any]:
        """One statement, committed on its own. ``relaxed``: its commit need not reach the disk before it returns
        (no fsync), because nothing is acknowledged on it alone: stitching's sequence-number claims, whose call is
        acknowledged only after the writer's commit, which flushes the log up to and past the claim."""
        async def run(conn: Any) -> list[Any]:
            cur = await conn.execute(for_postgres(sql), tuple(args))
            return await cur.fetchall()

        return await self._on_a_live_connection(self._relaxed if relaxed else self._pool, run)

    async def transaction(self, statements: list[Statement], *, returning: bool = False,
                          locked: bool = False) -> list[Any]:
        async def run(conn: Any) -> list[Any]:
            out: list[Any] = []
            async with conn.transaction():
                for sql, args in statements:
                    cur = await conn.execute(for_postgres(sql), args)
                    out.append([dict(row) for row in await cur.fetchall()] if returning else cur.rowcount)
            return out

        return await self._on_a_live_connection(self._pool, run)

    async def _on_a_live_connection(self, pool: Any, run: Callable[[Any], Any]) -> list[Any]:
        """``run`` on a pool connection. One the server dropped (a restart, a failover) is found dead only when
        used: the pool's idle connections are checked then, and ``run`` goes again once on a live one. What failed
        on a dead connection never reached the server, but for a commit lost in the instant the server went away."""
        import psycopg
        from psycopg_pool import PoolTimeout

        for attempt in (1, 2):
            try:
                async with pool.connection() as conn:
                    try:
                        return await run(conn)
                    except psycopg.OperationalError:
                        if attempt == 2 or not conn.broken:
                            raise
            except psycopg.OperationalError as exc:
                if attempt == 2 or not self.whole_store(exc):
                    raise StoreUnavailable(f"the store at {redact_url(self.url)} cannot be reached: {exc}") from exc
                log.warning("store.connection_lost", error=str(exc))
                await pool.check()
            except PoolTimeout as exc:
                raise StoreUnavailable(f"no connection to the store at {redact_url(self.url)}: {exc}") from exc
        raise AssertionError("unreachable")

    def commit_steps(self, steps: list[Step], statements: list[Statement], delay: float) -> None:
        import psycopg

        try:
            self._commit_steps(steps, statements, delay)
        except psycopg.OperationalError as exc:
            if not (self._batch_conn is not None and self._batch_conn.broken):
                raise
            # The server dropped the writer's connection (a restart, a failover): once more, on a new one.
            log.warning("store.writer_connection_lost", error=str(exc))
            self._commit_steps(steps, statements, delay)

    def _commit_steps(self, steps: list[Step], statements: list[Statement], delay: float) -> None:
        conn = self._batch_conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            conn = self._batch_conn = self.connect_sync()
        with conn.transaction(), conn.cursor() as cur:
            for sql, rows in steps:
                if rows:
                    cur.executemany(for_postgres(sql), rows)
            for sql, args in statements:
                cur.execute(for_postgres(sql), args)
            if delay:
                time.sleep(delay)

    @staticmethod
    def whole_store(exc: BaseException) -> bool:
        import psycopg

        # The connection or the server failed (OperationalError covers a lost connection, a shutdown, the disk
        # full); a row's own fault is a DataError or an IntegrityError, and is that write's alone.
        return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, StoreUnavailable))


def connect_postgres(url: str) -> Any:
    """A psycopg connection in autocommit mode, its rows ``Row``s; ``StoreUnavailable`` when it cannot be made, its
    message without the URL's password (libpq quotes back a URL it cannot parse, password and all)."""
    import psycopg

    try:
        return psycopg.connect(url, autocommit=True, row_factory=keyed_rows, connect_timeout=WAIT_SECONDS)
    except psycopg.Error as exc:
        reason = str(exc).replace(url, redact_url(url))
        raise StoreUnavailable(f"cannot connect to the store at {redact_url(url)}: {reason}") from None


class PostgresConnection:
    """A plain psycopg connection (autocommit) that takes the repositories' spelling, as ``sqlite3``'s does: for the
    short synchronous transactions of the adapter registry and the commands."""

    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        self.conn = connect_postgres(url)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self.conn.execute(for_postgres(sql), tuple(args))

    def begin_exclusive(self, key: int) -> None:
        """A transaction that runs alone among those that ask for ``key`` (SQLite's ``BEGIN IMMEDIATE``)."""
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))

    def close(self) -> None:
        self.conn.close()


Database = SQLiteDatabase | PostgresDatabase


def redact_url(url: str) -> str:
    """A database URL fit for a log line or an error message: its password replaced."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def open_database(location: str, *, synchronous: str, pool_size: int) -> Database:
    if is_postgres(location):
        return PostgresDatabase(location, pool_size=pool_size)
    return SQLiteDatabase(location, synchronous=synchronous)

