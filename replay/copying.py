"""Copying a whole store from one database to another (SQLite to PostgreSQL and back), resumably, and proving
the copy equal to its source.

SRC is only read, inside one snapshot (SQLite: one read transaction on a read-only connection; PostgreSQL: one
``REPEATABLE READ READ ONLY`` transaction), so every table is read as of one moment: a model call is never copied
without its trajectory, even while a gateway writes to SRC. DST is migrated to the newest schema first, then
filled table by table in the order the migrations created them, which is an order foreign keys allow (a
migration can only refer to a table that already exists; on PostgreSQL it must).

Each table is read in the order of its primary key and written in chunks, each chunk one transaction with
``ON CONFLICT DO NOTHING``. As chunks are committed in key order, the largest key in DST marks where the last run
stopped: a rerun starts after it and reads nothing twice (text keys are compared by their bytes on both sides,
so SRC and DST agree on what "after" means: ``replay.copy_ends``). Two tables are ordered otherwise:

- ``tool_calls`` (and any table PostgreSQL gives SQLite's implicit rowid as a column) is read in rowid order and
  written without the rowid, in that order, so DST's rowid (an identity on PostgreSQL) keeps a step's calls in
  the order they came. A rerun resumes after the SRC rowid of the DST row with the largest rowid.
- ``trajectory_text`` has no key at all (an FTS5 table on SQLite). It is read in trajectory order and each chunk
  holds whole trajectories only, so the largest ``trajectory_id`` in DST is again where to resume; recopying it
  whole in one transaction would be simpler, but a killed run would then lose all of it, and it is the size of
  the model calls' text.

``events.id`` is copied as it is; afterwards DST's counter (PostgreSQL's identity sequence, SQLite's
``sqlite_sequence``) is moved past every id SRC ever gave out, so new events never reuse an id.

Values keep their types exactly: SQLite's INTEGER, REAL, TEXT and BLOB are PostgreSQL's BIGINT, DOUBLE PRECISION,
TEXT and BYTEA, and a value SQLite's loose typing let into a column whose PostgreSQL type cannot hold it (text in
an INTEGER column, say) stops the copy with its table, row and column named.

The check at the end reads both sides in the same order and hashes every row, each value tagged with its type
(integers, floats by their shortest exact spelling, text as UTF-8, bytes), so equal hashes mean equal rows.
"""

from __future__ import annotations

import hashlib
import itertools
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from replay.copy_ends import CopyError, Side, Table, open_destination, open_source, same_location, tables
from replay.database import redact_url

CHUNK_ROWS = 1000

# (phase: "copy" or "verify", table, rows done, rows in all): after each table starts and each chunk is committed.
Progress = Callable[[str, str, int, int], None]


# -- copying ---------------------------------------------------------------------------------------------------


@dataclass
class TableCopy:
    table: str
    rows: int  # in SRC
    read: int  # read from SRC by this run (those before where it resumed are not)
    inserted: int  # new in DST
    seconds: float


def _resume_after(src: Side, dst: Side, table: Table) -> tuple[Any, ...] | None:
    """Where the last run stopped: the resume columns' values, in SRC, of the last row it committed to DST."""
    last_first = ", ".join(f"{dst.bytewise(c, t)} DESC" for c, t in zip(table.resume, table.text_order, strict=False))
    last = dst.one(f"SELECT {', '.join(table.label)} FROM {table.name} ORDER BY {last_first} LIMIT 1")
    if last is None or table.label == table.resume:
        return last
    # DST numbers its rowids itself: look up, in SRC, the one of the row it holds last (none: start over).
    same = " AND ".join(f"{c} = ?" for c in table.label)
    return src.one(f"SELECT {', '.join(table.resume)} FROM {table.name} WHERE {same}", last)


def _chunks(batches: Iterator[list[tuple[Any, ...]]], size: int, whole: bool) -> Iterator[list[tuple[Any, ...]]]:
    """Batches as they come; with ``whole``, cut only where the first column (the trajectory) changes."""
    if not whole:
        yield from batches
        return
    pending: list[tuple[Any, ...]] = []
    for batch in batches:
        for row in batch:
            if len(pending) >= size and row[0] != pending[-1][0]:
                yield pending
                pending = []
            pending.append(row)
    if pending:
        yield pending


_PYTHON_TYPES = {"INTEGER": int, "REAL": float, "TEXT": str, "BLOB": bytes}


def _conform(table: Table, rows: list[tuple[Any, ...]], skip: int) -> list[tuple[Any, ...]]:
    """The copied values of each row (after its ``skip`` order columns), checked for PostgreSQL's stricter types."""
    wanted = [_PYTHON_TYPES.get(t, object) for t in table.types]
    out = []
    for row in rows:
        values = row[skip:]
        for column, value, kind in zip(table.columns, values, wanted, strict=True):
            if value is not None and not isinstance(value, kind):
                name = dict(zip(table.columns, values, strict=True))
                which = ", ".join(f"{c}={name[c]!r}" for c in table.label)
                raise CopyError(f"{table.name} ({which}): column {column} holds {type(value).__name__} "
                                f"{value!r:.60}, which PostgreSQL's type for it cannot hold; mend the row in SRC")
        out.append(values)
    return out


def _copy_table(src: Side, dst: Side, table: Table, size: int, progress: Progress) -> TableCopy:
    started = time.monotonic()
    after = _resume_after(src, dst, table)
    select, args = src.select(table, after)
    total = src.count(table)
    remaining = src.count(table, after) if after else total
    conflict = " ON CONFLICT DO NOTHING" if table.key else ""  # no key, no conflicts (and FTS5 takes no UPSERT)
    insert = (f"INSERT INTO {table.name}({', '.join(table.columns)}) "
              f"VALUES ({', '.join('?' * len(table.columns))}){conflict}")
    read = inserted = 0
    progress("copy", table.name, total - remaining, total)
    for chunk in _chunks(src.stream(select, args, size), size, whole=not table.key):
        values = _conform(table, chunk, len(table.order)) if dst.postgres else [r[len(table.order):] for r in chunk]
        inserted += dst.write(insert, values)
        read += len(chunk)
        progress("copy", table.name, total - remaining + read, total)
    return TableCopy(table.name, total, read, inserted, time.monotonic() - started)


def _counter(side: Side, table: Table) -> int:
    """The largest id the table's counter ever gave out (0: none)."""
    if side.postgres:
        found = side.one(f"SELECT pg_sequence_last_value(pg_get_serial_sequence('{table.name}', "
                         f"'{table.key[0]}')::regclass)")
    else:
        found = side.one("SELECT seq FROM sqlite_sequence WHERE name = ?", (table.name,))
    largest = side.one(f"SELECT COALESCE(MAX({table.key[0]}), 0) FROM {table.name}")
    return max(largest[0] if largest else 0, (found[0] or 0) if found else 0)


def _carry_counter(src: Side, dst: Side, table: Table) -> None:
    """DST's counter past every id SRC gave out (a deleted row's too) and every id DST holds."""
    value = max(_counter(src, table), _counter(dst, table))
    if not value:
        return
    if dst.postgres:
        dst.one(f"SELECT setval(pg_get_serial_sequence('{table.name}', '{table.key[0]}'), ?)", (value,))
    elif not dst.conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = ?", (value, table.name)).rowcount:
        dst.conn.execute("INSERT INTO sqlite_sequence(name, seq) VALUES (?, ?)", (table.name, value))


# -- checking --------------------------------------------------------------------------------------------------


@dataclass
class TableCheck:
    table: str
    source_rows: int
    destination_rows: int
    source_hash: str
    destination_hash: str
    # Where the two first differ, in reading order: the label of SRC's row and of DST's there (None: no more rows).
    first_difference: tuple[dict[str, Any] | None, dict[str, Any] | None] | None = None

    @property
    def ok(self) -> bool:
        return self.first_difference is None

    def describe(self) -> str:
        """The difference, for a person."""
        if self.first_difference is None:
            return "the same"
        ours, theirs = (", ".join(f"{k}={v!r}" for k, v in row.items()) if row else None
                        for row in self.first_difference)
        where = (f"row {ours} differs" if ours == theirs else
                 f"DST has no row where SRC has {ours}" if theirs is None else
                 f"DST has {theirs}, which SRC has not" if ours is None else
                 f"SRC has {ours} where DST has {theirs}")
        return f"{self.source_rows:,} rows in SRC, {self.destination_rows:,} in DST; first difference: {where}"


def _encode(values: Sequence[Any]) -> bytes:
    """A row's values, each tagged with its type and self-delimiting, so equal bytes mean equal rows."""
    out = bytearray()
    for v in values:
        if v is None:
            out += b"N"
        elif isinstance(v, int):
            out += b"I%d;" % v
        elif isinstance(v, float):
            out += b"F" + repr(v).encode() + b";"
        elif isinstance(v, str):
            data = v.encode()
            out += b"S%d:" % len(data) + data
        else:
            data = bytes(v)
            out += b"B%d:" % len(data) + data
    return bytes(out)


def _label(table: Table, row: tuple[Any, ...] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    values = dict(zip(table.columns, row[len(table.order):], strict=True))
    return {c: values[c] for c in table.label}


def _rows(side: Side, table: Table, size: int) -> Iterator[tuple[Any, ...]]:
    select, args = side.select(table)
    for batch in side.stream(select, args, size):
        yield from batch


def _check_table(src: Side, dst: Side, table: Table, size: int, progress: Progress) -> TableCheck:
    hashes = [hashlib.sha256(), hashlib.sha256()]
    counts = [0, 0]
    first: tuple[dict[str, Any] | None, dict[str, Any] | None] | None = None
    skip = len(table.order)
    total = src.count(table)
    progress("verify", table.name, 0, total)
    for a, b in itertools.zip_longest(_rows(src, table, size), _rows(dst, table, size)):
        encoded = []
        for i, row in enumerate((a, b)):
            if row is not None:
                counts[i] += 1
                encoded.append(_encode(row[skip:]))
                hashes[i].update(encoded[-1])
            else:
                encoded.append(None)
        if first is None and encoded[0] != encoded[1]:
            first = (_label(table, a), _label(table, b))
        if a is not None and counts[0] % size == 0 and counts[0] < total:
            progress("verify", table.name, counts[0], total)
    progress("verify", table.name, total, total)
    return TableCheck(table.name, counts[0], counts[1], hashes[0].hexdigest(), hashes[1].hexdigest(), first)


# -- the whole of it -------------------------------------------------------------------------------------------


@dataclass
class Migration:
    copies: list[TableCopy] = field(default_factory=list)
    checks: list[TableCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def _quiet(phase: str, table: str, done: int, total: int) -> None:
    return None


def migrate_store(source: str, destination: str, *, chunk_rows: int = CHUNK_ROWS, verify_only: bool = False,
                  on_progress: Progress | None = None) -> Migration:
    """Copy every table of ``source`` into ``destination`` (resuming a run that stopped), then compare the two row
    by row. ``verify_only``: compare only, changing neither. Raises CopyError when the copy cannot be made; a
    copy that differs is a ``Migration`` that is not ``ok``."""
    import psycopg

    if chunk_rows < 1:
        raise CopyError("the chunk size must be at least one row")
    if same_location(source, destination):
        raise CopyError(f"SRC and DST are the same store ({redact_url(source)})")
    progress = on_progress or _quiet
    result = Migration()
    try:
        with ExitStack() as stack:
            src = stack.enter_context(open_source(source))
            dst = stack.enter_context(open_source(destination) if verify_only else open_destination(destination))
            if not verify_only:
                for table in tables():
                    result.copies.append(_copy_table(src, dst, table, chunk_rows, progress))
                    if table.counter:
                        _carry_counter(src, dst, table)
                dst.snapshot()
            result.checks = [_check_table(src, dst, table, chunk_rows, progress) for table in tables()]
    except (sqlite3.Error, psycopg.Error) as exc:
        raise CopyError(f"copying {redact_url(source)} to {redact_url(destination)} failed: "
                        f"{str(exc).strip()}") from None
    return result
