"""The two ends of a store copy (``replay.copying``): the store's tables as its schema defines them, and SRC and
DST opened for it, each read in one order both databases agree on.

SRC is opened read-only inside one snapshot; DST is created (a new SQLite file) and migrated to the newest schema.
Text is compared by its bytes on both sides (``COLLATE "C"`` on PostgreSQL, whose database collation may put
``"B"`` after ``"a"``; SQLite's ``BINARY``), so SRC and DST agree on which row comes after which.
"""

from __future__ import annotations

import functools
import itertools
import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.database import PostgresConnection, for_postgres, is_postgres, redact_url
from replay.readonly import StoreError, check_file, open_readonly, schema_version
from replay.schema import POSTGRES, SCHEMA_VERSION, migrate, migrate_postgres


class CopyError(Exception):
    """A copy that cannot be made; the message says why, for a person."""


# -- the tables, read from the schema --------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[str, ...]  # what is copied and hashed
    types: tuple[str, ...]  # each column's SQLite type: INTEGER, REAL, TEXT or BLOB
    key: tuple[str, ...]  # the primary key; none for trajectory_text
    order: tuple[str, ...]  # what rows are read, written and hashed in
    resume: tuple[str, ...]  # the leading columns of ``order`` a rerun starts after
    text_order: tuple[bool, ...]  # which of ``order`` are text, compared by their bytes
    counter: bool  # an AUTOINCREMENT key: DST's counter must pass SRC's

    @property
    def label(self) -> tuple[str, ...]:
        """The columns that name a row for a person."""
        return self.key or self.resume


def _rowid_tables() -> frozenset[str]:
    """The tables PostgreSQL gives SQLite's implicit rowid as a column, to keep their rows' order."""
    return frozenset(re.findall(r"ALTER TABLE (\w+) ADD COLUMN rowid\b", " ".join(POSTGRES.values())))


@functools.cache
def tables() -> tuple[Table, ...]:
    """Every table of the store, in the order the migrations created them (one foreign keys allow)."""
    conn = sqlite3.connect(":memory:")
    try:
        migrate(conn)
        found = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY rowid").fetchall()
        virtual = [name for name, sql in found if sql.upper().startswith("CREATE VIRTUAL")]
        out = []
        for name, sql in found:
            if name.startswith("sqlite_") or any(name.startswith(v + "_") for v in virtual):
                continue  # SQLite's own bookkeeping, and the shadow tables behind a virtual one
            info = conn.execute(f"PRAGMA table_info({name})").fetchall()  # cid, name, type, notnull, default, pk
            columns = tuple(r[1] for r in info)
            # A virtual table's columns have no type; FTS5's hold text.
            types = tuple((r[2] or ("TEXT" if name in virtual else "BLOB")).upper() for r in info)
            key = tuple(r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5]))
            if name in _rowid_tables():
                order, resume = ("rowid",), ("rowid",)
            elif key:
                order = resume = key
            elif "trajectory_id" in columns:  # no key: whole trajectories, every column for a stable hash order
                order, resume = ("trajectory_id", *(c for c in columns if c != "trajectory_id")), ("trajectory_id",)
            else:
                raise RuntimeError(f"table {name} has neither a key nor a trajectory_id to copy it by")
            kinds = dict(zip(columns, types, strict=True))
            out.append(Table(name=name, columns=columns, types=types, key=key, order=order, resume=resume,
                             text_order=tuple(kinds.get(c) == "TEXT" for c in order),
                             counter="AUTOINCREMENT" in sql.upper()))
        return tuple(out)
    finally:
        conn.close()


# -- one end of a copy -----------------------------------------------------------------------------------------


class Side:
    """SRC or DST: an SQLite connection or a PostgreSQL one, spoken to in the repositories' spelling."""

    def __init__(self, location: str, conn: Any) -> None:
        self.location = location
        self.postgres = is_postgres(location)
        self.conn = conn  # sqlite3.Connection (autocommit) or PostgresConnection
        self._cursors = itertools.count()

    @property
    def name(self) -> str:
        return redact_url(self.location) if self.postgres else self.location

    def bytewise(self, column: str, text: bool) -> str:
        return f'{column} COLLATE "C"' if self.postgres and text else column

    def one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        row = self.conn.execute(sql, tuple(args)).fetchone()
        return None if row is None else tuple(row)

    def stream(self, sql: str, args: Sequence[Any], size: int) -> Iterator[list[tuple[Any, ...]]]:
        """A query's rows in batches, held on the server (PostgreSQL: a named cursor in the open transaction)."""
        if self.postgres:
            from psycopg.rows import tuple_row

            cursor = self.conn.conn.cursor(name=f"copy_{next(self._cursors)}", row_factory=tuple_row)
            cursor.execute(for_postgres(sql), tuple(args))
        else:
            cursor = self.conn.execute(sql, tuple(args))
        try:
            while batch := cursor.fetchmany(size):
                yield batch
        finally:
            cursor.close()

    def write(self, sql: str, rows: list[tuple[Any, ...]]) -> int:
        """Rows inserted in one transaction; how many were new."""
        if self.postgres:
            with self.conn.conn.transaction(), self.conn.conn.cursor() as cursor:
                cursor.executemany(for_postgres(sql), rows)
                return cursor.rowcount
        self.conn.execute("BEGIN")
        try:
            inserted = self.conn.executemany(sql, rows).rowcount
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        return inserted

    def _after(self, table: Table, after: tuple[Any, ...] | None) -> str:
        """The condition for the rows after a resume point (the resume columns' values), if there is one."""
        if after is None:
            return ""
        resumed = [self.bytewise(c, t) for c, t in zip(table.resume, table.text_order, strict=False)]
        return f" WHERE ({', '.join(resumed)}) > ({', '.join('?' * len(resumed))})"

    def select(self, table: Table, after: tuple[Any, ...] | None = None) -> tuple[str, tuple[Any, ...]]:
        """The rows of ``table`` in its order, after a resume point: the order's columns, then the copied ones."""
        order = ", ".join(self.bytewise(c, t) for c, t in zip(table.order, table.text_order, strict=True))
        return (f"SELECT {', '.join(table.order)}, {', '.join(table.columns)} FROM {table.name}"
                f"{self._after(table, after)} ORDER BY {order}", after or ())

    def count(self, table: Table, after: tuple[Any, ...] | None = None) -> int:
        found = self.one(f"SELECT COUNT(*) FROM {table.name}{self._after(table, after)}", after or ())
        return found[0] if found else 0

    def snapshot(self) -> None:
        """Every read from now on sees the database as of one moment."""
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if self.postgres else "BEGIN")
        self.conn.execute("SELECT 1 FROM trajectories LIMIT 1").fetchall()  # SQLite's snapshot starts at a read


def _upgrade_hint(location: str) -> str:
    variable = "HARNESS_STORE__URL" if is_postgres(location) else "HARNESS_STORE__PATH"
    return (f"migrate never changes SRC: upgrade it first by opening it once with this version, for example "
            f"'{variable}={redact_url(location)} harness trajectories list'")


@contextmanager
def _postgres(location: str) -> Iterator[Side]:
    try:
        conn = PostgresConnection(location)
    except RuntimeError as exc:  # StoreUnavailable, its message without the password
        raise CopyError(str(exc)) from None
    try:
        yield Side(location, conn)
    finally:
        conn.close()


@contextmanager
def open_source(location: str) -> Iterator[Side]:
    """A store of the current schema opened for reading only, inside one snapshot."""
    if is_postgres(location):
        with _postgres(location) as side:
            found = side.one("SELECT to_regclass('schema_version') IS NOT NULL")
            version = side.one("SELECT version FROM schema_version") if found and found[0] else None
            if version is None:
                raise CopyError(f"{side.name} is not a trajectory store (it has no schema_version)")
            _check_version(location, version[0])
            side.snapshot()
            yield side
        return
    try:
        _check_version(location, schema_version(location))
        with open_readonly(location) as conn:
            side = Side(location, conn)
            side.snapshot()
            yield side
    except StoreError as exc:
        raise CopyError(str(exc)) from None


def _check_version(location: str, version: int) -> None:
    name = redact_url(location)
    if version > SCHEMA_VERSION:
        raise CopyError(f"{name} has schema version {version}, newer than this program knows ({SCHEMA_VERSION}); "
                        "upgrade the harness to copy it")
    if version < SCHEMA_VERSION:
        raise CopyError(f"{name} has schema version {version}, older than this program's ({SCHEMA_VERSION}); "
                        + _upgrade_hint(location))


@contextmanager
def open_destination(location: str) -> Iterator[Side]:
    """The store to fill, created when it is a new SQLite file, and migrated to the newest schema."""
    if is_postgres(location):
        with _postgres(location) as side:
            try:
                migrate_postgres(side.conn.conn)
            except RuntimeError as exc:
                raise CopyError(str(exc)) from None
            yield side
        return
    path = Path(location)
    if path.exists():
        try:
            check_file(path)
        except StoreError as exc:
            raise CopyError(str(exc)) from None
    elif not path.parent.is_dir():
        raise CopyError(f"cannot create {path}: no directory {path.parent}")
    conn = sqlite3.connect(location, isolation_level=None)
    try:
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=10000"):
            conn.execute(f"PRAGMA {pragma}")
        try:
            migrate(conn)
        except RuntimeError as exc:
            raise CopyError(f"{location}: {exc}") from None
        yield Side(location, conn)
    finally:
        conn.close()


def same_location(a: str, b: str) -> bool:
    """Whether two locations name one store (the same file, or the same database on the same server)."""
    if is_postgres(a) != is_postgres(b):
        return False
    if is_postgres(a):
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        def where(url: str) -> tuple[str, str, str]:
            info = conninfo_to_dict(url)
            return (str(info.get("host") or "localhost"), str(info.get("port") or 5432),
                    str(info.get("dbname") or info.get("user") or ""))

        try:
            return where(a) == where(b)
        except psycopg.ProgrammingError:  # a malformed URL: connecting to it says so
            return a == b
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.samefile(pb)
    return pa.resolve() == pb.resolve()
