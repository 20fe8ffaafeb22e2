"""The process sql_query's statements run in: one statement at a time, read from stdin, answered on stdout.

It runs as ``python -I -S sql_worker.py MAX_MEMORY`` and imports nothing but the standard library, so it starts in
tens of milliseconds and its own footprint is small. Running statements here rather than in the gateway is what
bounds a whole statement's memory: SQLite's heap limit is process-wide, and in the gateway it would also fail
the trajectory store's commits. Here ``PRAGMA hard_heap_limit`` caps everything SQLite allocates (aggregates
such as ``json_group_array`` grow their buffers past ``SQLITE_LIMIT_LENGTH`` before checking it), and an
address-space limit (``RLIMIT_AS``) catches whatever Python allocates around it.

Locks, each enough on its own for some attacks and together for all we know of: the file is opened read-only
(``mode=ro``), ``query_only`` is on, an authorizer allows nothing but reading (no writes, no ATTACH/DETACH,
only harmless pragmas, no transactions, and only the SQL functions on an allow-list: a deny-list let
``fts3_tokenizer`` hand out a native pointer). Memory: no value may exceed ``max_bytes`` (``SQLITE_LIMIT_LENGTH``,
so ``randomblob(900000000)`` fails at once), fetching stops once the rows hold that many bytes, and the heap and
address-space limits above bound the rest. Time: a progress handler interrupts a query past its limit between
steps, and a timer interrupts the connection at the deadline from outside (one long step never reaches the
handler); the gateway kills this process if even that fails.

Frames both ways are a 4-byte big-endian length and that many bytes of JSON. A request is
``{"database", "query", "timeout", "max_rows", "max_bytes"}``; the reply ``{"result": {...}}`` or
``{"error": "...", "recycle": bool}`` (``recycle``: this process should not be trusted with another query).
"""

from __future__ import annotations

import json
import sqlite3
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

try:
    import resource
except ImportError:  # not on Windows: the heap limit alone bounds SQLite there
    resource = None  # type: ignore[assignment]

# Pragmas that only describe the schema; every other pragma (including all that set a value) is denied.
READ_ONLY_PRAGMAS = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list",
})
_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
# SQL functions a query may call: SQLite's core, aggregate, window, date, math and JSON functions and the
# full-text search helpers for reading FTS tables. Everything else (load_extension, fts3_tokenizer and fts5,
# which deal in native pointers, sqlite_log, the r-tree debugging functions, anything an extension adds) is
# refused. Names of newer SQLite releases are listed too, so an upgrade does not break queries.
ALLOWED_FUNCTIONS = frozenset({
    # core scalar
    "abs", "changes", "char", "coalesce", "concat", "concat_ws", "format", "glob", "hex", "ifnull", "iif", "if",
    "instr", "last_insert_rowid", "length", "like", "likelihood", "likely", "lower", "ltrim", "max", "min",
    "nullif", "octet_length", "printf", "quote", "random", "randomblob", "replace", "round", "rtrim", "sign",
    "soundex", "sqlite_compileoption_get", "sqlite_compileoption_used", "sqlite_source_id", "sqlite_version",
    "substr", "substring", "subtype", "total_changes", "trim", "typeof", "unhex", "unicode", "unistr",
    "unistr_quote", "unlikely", "upper", "zeroblob",
    # aggregate
    "avg", "count", "group_concat", "string_agg", "sum", "total", "median", "percentile", "percentile_cont",
    "percentile_disc",
    # window
    "row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag", "lead", "first_value",
    "last_value", "nth_value",
    # date and time
    "date", "time", "datetime", "julianday", "unixepoch", "strftime", "timediff", "current_date", "current_time",
    "current_timestamp",
    # math
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos", "cosh", "degrees", "exp",
    "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow", "power", "radians", "sin", "sinh", "sqrt", "tan",
    "tanh", "trunc",
    # JSON
    "->", "->>", "json", "jsonb", "json_array", "jsonb_array", "json_array_length", "json_error_position",
    "json_extract", "jsonb_extract", "json_insert", "jsonb_insert", "json_object", "jsonb_object", "json_patch",
    "jsonb_patch", "json_pretty", "json_quote", "json_remove", "jsonb_remove", "json_replace", "jsonb_replace",
    "json_set", "jsonb_set", "json_type", "json_valid", "json_group_array", "jsonb_group_array",
    "json_group_object", "jsonb_group_object", "json_each", "json_tree",
    # reading full-text search tables
    "match", "bm25", "highlight", "snippet", "offsets", "matchinfo",
})
# LIKE and GLOB patterns longer than this are refused: matching cost grows with the pattern.
_MAX_PATTERN = 1000
# Authorizer action codes by name, for refusals that say what was refused.
_ACTION_NAMES = {
    getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ")
    for name in (
        "ALTER_TABLE", "ANALYZE", "ATTACH", "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX",
        "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW",
        "CREATE_VTABLE", "DELETE", "DETACH", "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE",
        "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "DROP_VTABLE", "FUNCTION", "INSERT",
        "PRAGMA", "REINDEX", "SAVEPOINT", "TRANSACTION", "UPDATE",
    )
}
# How many SQLite virtual-machine steps run between two looks at the clock.
_PROGRESS_STEPS = 10_000
MIB = 1 << 20
# Room in the address space, past the SQLite heap, for Python itself: the fetched rows as objects and as JSON
# (escaping can make a string up to six times longer), and the interrupt timer's thread stack.
_PYTHON_ROOM = 64 * MIB
_ROWS_FACTOR = 8


class QueryError(Exception):
    """The statement was refused or failed; the message says why, for the model."""


class OutOfMemory(QueryError):
    """The statement needed more memory than the limit."""


def memory_message(max_memory: int) -> str:
    return (f"the query needs more than {max_memory // MIB} MiB of memory ([tools] sql_max_memory_mb); "
            "aggregate fewer or smaller values")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    return value


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes) else 8


def run_statement(database: str, query: str, *, timeout: float, max_rows: int, max_bytes: int,
                  max_memory: int) -> dict[str, Any]:
    """Runs one read-only statement in this process; raises ``QueryError`` with a message for the model."""
    path = Path(database).expanduser().resolve()
    if not path.is_file():
        raise QueryError(f"the database {database} does not exist")
    denied: list[str] = []

    def authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        # For a function SQLite passes its name second (the first is always NULL).
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in ALLOWED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in READ_ONLY_PRAGMAS:
            return sqlite3.SQLITE_OK
        what = _ACTION_NAMES.get(action, str(action))
        if action == sqlite3.SQLITE_FUNCTION:
            what = f"{what} {arg2}"
        elif action == sqlite3.SQLITE_PRAGMA:
            what = f"{what} {arg1}"
        denied.append(what)
        return sqlite3.SQLITE_DENY

    deadline = time.monotonic() + timeout
    connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=timeout, check_same_thread=False)
    alarm = threading.Timer(timeout, connection.interrupt)
    alarm.daemon = True
    try:
        # Process-wide, and a pragma may only lower it: the first statement sets it for this process's life.
        connection.execute(f"PRAGMA hard_heap_limit = {int(max_memory)}")
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_bytes)
        connection.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, _MAX_PATTERN)
        # A sort of large rows keeps one record per merged run in memory; with a 16 MB cache its runs are big
        # enough that a sort stays within ~40 MB at the default value limit (measured: 4 MB of cache, 78 MB).
        connection.execute("PRAGMA cache_size = -16000")
        connection.execute("PRAGMA query_only = ON")
        # A schema written by someone else must not run functions through views or triggers.
        connection.execute("PRAGMA trusted_schema = OFF")
        connection.set_authorizer(authorize)
        connection.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
        alarm.start()
        rows: list[tuple[Any, ...]] = []
        size, truncated = 0, False
        try:
            cursor = connection.execute(query)
            for row in cursor:
                size += sum(_size(v) for v in row)
                if len(rows) == max_rows or size > max_bytes:
                    truncated = True
                    break
                rows.append(row)
        except sqlite3.Error as exc:
            if denied:
                raise QueryError(f"only reading is allowed; refused: {', '.join(dict.fromkeys(denied))}") from None
            if time.monotonic() > deadline:
                raise QueryError(f"the query ran longer than its limit of {timeout:g}s") from None
            if "out of memory" in str(exc):
                raise OutOfMemory(memory_message(max_memory)) from None
            if isinstance(exc, sqlite3.DataError) or "too big" in str(exc):
                raise QueryError(f"a value would exceed the limit of {max_bytes} bytes ({exc})") from None
            raise QueryError(f"{type(exc).__name__}: {exc}") from None
        except sqlite3.Warning as exc:  # e.g. more than one statement
            raise QueryError(str(exc)) from None
        except MemoryError:  # SQLITE_NOMEM: the heap limit, or the address-space limit under it
            raise OutOfMemory(memory_message(max_memory)) from None
        columns = [c[0] for c in cursor.description or ()]
    finally:
        alarm.cancel()
        connection.close()
    return {
        "columns": columns,
        "rows": [[_jsonable(v) for v in row] for row in rows],
        "row_count": len(rows),
        "truncated": truncated,
    }


def _address_space() -> int | None:
    """This process's mapped address space in bytes (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None


def _limit_address_space(base: int | None, max_memory: int, max_bytes: int) -> None:
    # Only the soft limit moves, so a later request with a larger max_bytes may raise it again.
    if resource is None or base is None:
        return
    limit = base + max_memory + _PYTHON_ROOM + _ROWS_FACTOR * max_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _answer(request: dict[str, Any], max_memory: int, base: int | None) -> dict[str, Any]:
    try:
        _limit_address_space(base, max_memory, int(request["max_bytes"]))
        result = run_statement(request["database"], request["query"], timeout=float(request["timeout"]),
                               max_rows=int(request["max_rows"]), max_bytes=int(request["max_bytes"]),
                               max_memory=max_memory)
        return {"result": result}
    except OutOfMemory as exc:
        return {"error": str(exc), "recycle": True}
    except QueryError as exc:
        return {"error": str(exc), "recycle": False}
    except MemoryError:
        # Python itself ran into the address-space limit: what it left behind is not worth trusting.
        return {"error": memory_message(max_memory), "recycle": True}
    except Exception as exc:  # noqa: BLE001 - anything else still gets an answer, and a fresh process
        return {"error": f"{type(exc).__name__}: {exc}", "recycle": True}


def _read_exactly(stream: BinaryIO, count: int) -> bytes | None:
    data = stream.read(count)
    return data if data is not None and len(data) == count else None


def _encode(reply: dict[str, Any]) -> bytes:
    try:
        body = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
    except MemoryError:
        body = json.dumps({"error": "the rows were too large to send back", "recycle": True}).encode()
    return struct.pack(">I", len(body)) + body


def serve(max_memory: int, inbound: BinaryIO, outbound: BinaryIO) -> None:
    """Answers requests until the gateway closes the pipe (also when the gateway dies)."""
    # Measured once, after SQLite has started and a timer thread has run (its stack stays mapped for the next),
    # so the limit leaves the same room on every request.
    sqlite3.connect(":memory:").close()
    warm = threading.Timer(0, lambda: None)
    warm.start()
    warm.join()
    base = _address_space()
    while (header := _read_exactly(inbound, 4)) is not None:
        body = _read_exactly(inbound, struct.unpack(">I", header)[0])
        if body is None:
            return
        outbound.write(_encode(_answer(json.loads(body), max_memory, base)))
        outbound.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer)
