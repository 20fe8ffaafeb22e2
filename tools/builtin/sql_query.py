"""sql_query: read-only SQL on the SQLite file named by ``[tools] sql_database``.

Locks, each enough on its own for some attacks and together for all we know of: the file is opened read-only
(``mode=ro``), ``query_only`` is on, an authorizer allows nothing but reading (no writes, no ATTACH/DETACH,
only harmless pragmas, no transactions, and only the SQL functions on an allow-list: a deny-list let
``fts3_tokenizer`` hand out a native pointer). Memory: no value may exceed ``sql_max_bytes``
(``SQLITE_LIMIT_LENGTH``, so ``randomblob(900000000)`` fails at once) and fetching stops once the rows hold that
many bytes. Time: a progress handler interrupts a query past its limit between steps, and a timer interrupts
the connection at the deadline from outside, so the worker thread never outlives the call for long.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from tools.context import ToolContext
from tools.settings import ToolsSettings
from tools.spec import ToolError, ToolSpec

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


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    return value


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes) else 8


def run_query(database: str, query: str, *, timeout: float, max_rows: int, max_bytes: int) -> dict[str, Any]:
    """Runs one read-only statement; blocking, so callers run it in a worker thread."""
    path = Path(database).expanduser().resolve()
    if not path.is_file():
        raise ToolError(f"the database {database} does not exist")
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
    # From outside: a single step (one long function call) never reaches the progress handler.
    alarm = threading.Timer(timeout, connection.interrupt)
    alarm.daemon = True
    try:
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
                raise ToolError(f"only reading is allowed; refused: {', '.join(dict.fromkeys(denied))}") from None
            if time.monotonic() > deadline:
                raise ToolError(f"the query ran longer than its limit of {timeout:g}s") from None
            if isinstance(exc, sqlite3.DataError) or "too big" in str(exc):
                raise ToolError(f"a value would exceed the limit of {max_bytes} bytes ({exc})") from None
            raise ToolError(f"{type(exc).__name__}: {exc}") from None
        except sqlite3.Warning as exc:  # e.g. more than one statement
            raise ToolError(str(exc)) from None
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


async def _run(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
    settings = context.settings
    if not settings.sql_database:
        raise ToolError("no database is configured ([tools] sql_database)")
    return await asyncio.to_thread(
        run_query, settings.sql_database, arguments["query"],
        timeout=settings.sql_timeout, max_rows=settings.sql_max_rows, max_bytes=settings.sql_max_bytes,
    )


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="sql_query",
        description=(
            "Run one read-only SQL query (SQLite dialect) on the configured database and get the columns and "
            f"rows (at most {settings.sql_max_rows}). List tables with SELECT name, sql FROM sqlite_master; "
            "describe one with PRAGMA table_info(name)."
        ),
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1, "description": "one SELECT statement"}},
            "required": ["query"],
            "additionalProperties": False,
        },
        run=_run,
        # The query's own limit fires first; this leaves room to open the file and return rows.
        timeout=settings.sql_timeout + 5.0,
        output_cap=settings.output_cap,
        permissions=frozenset({"database:read"}),
    )
