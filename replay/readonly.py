"""Opening a store for reading only: the read commands (stats, export) must never change it.

``mode=ro`` opens the file read-only and still takes SQLite's shared locks, so a store the gateway is
writing to right now reads consistently (including what is still in its WAL). Two things it does not do:

- migrate: a store older than this program's schema is refused (opening it once with a write command
  upgrades it), and a newer one too (this program would misread it);
- leave the directory as it found it: a read-only connection to a WAL database that no one else has
  open creates an empty ``-wal`` and a ``-shm`` file and, unable to write, cannot delete them on close.
  After closing, when it was this connection that created them and the WAL is still empty, a plain
  connection is opened and closed: SQLite then removes them itself, under its own locks (so never
  from under a writer that opened the store meanwhile), and with an empty WAL it has nothing to copy
  into the database file, which stays byte-identical.

``immutable=1`` would avoid the side files but reads without locks: a gateway starting up and
checkpointing during a long export could hand it a torn page. Correctness wins over tidiness here.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import structlog

from replay.database import is_postgres, redact_url
from replay.schema import SCHEMA_VERSION

log = structlog.get_logger()

SQLITE_HEADER = b"SQLite format 3\x00"
# The tables the read commands query; each was created by some migration up to SCHEMA_VERSION.
REQUIRED_TABLES = ("trajectories", "model_calls", "blobs", "tool_calls")


class StoreError(Exception):
    """The store cannot be read; the message says why, for a person."""


def check_file(path: str | os.PathLike[str]) -> Path:
    """The path, if it names an SQLite file; a clear StoreError otherwise."""
    if is_postgres(str(path)):
        raise StoreError(f"{redact_url(str(path))} is a PostgreSQL store; this command reads an SQLite file: copy the "
                         "store into one first with 'harness store migrate URL FILE' and pass the file with --store")
    p = Path(path)
    if not p.exists():
        raise StoreError(f"no store at {p}")
    if not p.is_file():
        raise StoreError(f"{p} is not a file")
    try:
        with p.open("rb") as fh:
            header = fh.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise StoreError(f"cannot read {p}: {exc.strerror or exc}") from None
    if header != SQLITE_HEADER:
        raise StoreError(f"{p} is not an SQLite database (it may be corrupt, or some other file)")
    return p


def check_schema(conn: sqlite3.Connection, path: Path) -> int:
    """The store's schema version, if it is exactly the one this program reads."""
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path} cannot be read as a store: {exc}") from None
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path} has schema version {version}, newer than this program knows ({SCHEMA_VERSION}); "
                         "upgrade the harness to read it")
    missing = [t for t in REQUIRED_TABLES if t not in tables]
    if version == 0 and not tables:
        raise StoreError(f"{path} is an empty SQLite database, not a trajectory store")
    if version < SCHEMA_VERSION or missing:
        detail = f" (missing tables: {', '.join(missing)})" if missing else ""
        raise StoreError(f"{path} has schema version {version}, older than this program's ({SCHEMA_VERSION}){detail}; "
                         "read commands never migrate a store: open it once with a write command (for example "
                         "'harness trajectories list') to upgrade it")
    return version


def schema_version(path: str | os.PathLike[str]) -> int:
    """The schema version of an existing SQLite file, read without changing it (for write commands that
    want to refuse a newer store before opening it for writing)."""
    p = check_file(path).resolve()
    side_files = [Path(f"{p}-wal"), Path(f"{p}-shm")]
    existed = [f.exists() for f in side_files]
    try:
        conn = sqlite3.connect(f"file:{quote(str(p))}?mode=ro", uri=True)
        try:
            return conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{p} cannot be read as a store: {exc}") from None
    finally:
        _tidy(p, side_files, existed)


@contextmanager
def open_readonly(path: str | os.PathLike[str]) -> Iterator[sqlite3.Connection]:
    """A read-only connection to a store of the current schema, tidied up after (see the module doc)."""
    p = check_file(path).resolve()
    side_files = [Path(f"{p}-wal"), Path(f"{p}-shm")]
    existed = [f.exists() for f in side_files]
    try:
        # isolation_level=None: no implicit transactions; readers open their own snapshot with BEGIN.
        conn = sqlite3.connect(f"file:{quote(str(p))}?mode=ro", uri=True, isolation_level=None,
                               check_same_thread=False)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {p}: {exc}") from None
    try:
        conn.execute("PRAGMA query_only = ON")  # belt and braces: mode=ro already refuses writes
        conn.execute("PRAGMA busy_timeout = 10000")
        check_schema(conn, p)
        yield conn
    finally:
        conn.close()
        _tidy(p, side_files, existed)


def _tidy(path: Path, side_files: list[Path], existed: list[bool]) -> None:
    wal, _ = side_files
    created = any(f.exists() and not was for f, was in zip(side_files, existed, strict=True))
    if not created:
        return
    try:
        if wal.exists() and wal.stat().st_size > 0:
            return  # someone wrote meanwhile: their files, their checkpoint
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=rw", uri=True)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        finally:
            conn.close()
    except (OSError, sqlite3.Error) as exc:  # a read-only directory or file: leaving them is harmless
        log.debug("replay.readonly.tidy_skipped", path=str(path), error=str(exc))
