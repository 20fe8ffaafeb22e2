"""sql_query: read-only SQL on the SQLite file named by ``[tools] sql_database``.

Four locks, each enough on its own for some attacks and together for all we know of: the file is
opened read-only (``mode=ro``), ``query_only`` is on, an authorizer allows nothing but reading
(no writes, no ATTACH/DETACH, only harmless pragmas, no transactions), and a progress handler
interrupts a query past its time limit (a runaway recursive CTE would otherwise hold a thread forever).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

from gateway.config import ToolsSettings
from tools.context import ToolContext
from tools.spec import ToolError, ToolSpec

# Pragmas that only describe the schema; every other pragma (including all that set a value) is denied.
READ_ONLY_PRAGMAS = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list",
})
_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_DENIED_FUNCTIONS = frozenset({"load_extension"})
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


def run_query(database: str, query: str, *, timeout: float, max_rows: int) -> dict[str, Any]:
    """Runs one read-only statement; blocking, so callers run it in a worker thread."""
    path = Path(database).expanduser().resolve()
    if not path.is_file():
        raise ToolError(f"the database {database} does not exist")
    denied: list[str] = []

    def authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in READ_ONLY_PRAGMAS:
            return sqlite3.SQLITE_OK
        what = _ACTION_NAMES.get(action, str(action))
        denied.append(f"{what} {arg1}" if action in (sqlite3.SQLITE_PRAGMA, sqlite3.SQLITE_FUNCTION) else what)
        return sqlite3.SQLITE_DENY

    deadline = time.monotonic() + timeout
    connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=timeout, check_same_thread=False)
    try:
        connection.execute("PRAGMA query_only = ON")
        # A schema written by someone else must not run functions through views or triggers.
        connection.execute("PRAGMA trusted_schema = OFF")
        connection.set_authorizer(authorize)
        connection.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
        try:
            cursor = connection.execute(query)
            rows = cursor.fetchmany(max_rows + 1)
        except sqlite3.Error as exc:
            if denied:
                raise ToolError(f"only reading is allowed; refused: {', '.join(dict.fromkeys(denied))}") from None
            if time.monotonic() > deadline:
                raise ToolError(f"the query ran longer than its limit of {timeout:g}s") from None
            raise ToolError(f"{type(exc).__name__}: {exc}") from None
        except sqlite3.Warning as exc:  # e.g. more than one statement
            raise ToolError(str(exc)) from None
        columns = [c[0] for c in cursor.description or ()]
    finally:
        connection.close()
    return {
        "columns": columns,
        "rows": [[_jsonable(v) for v in row] for row in rows[:max_rows]],
        "row_count": min(len(rows), max_rows),
        "truncated": len(rows) > max_rows,
    }


async def _run(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
    settings = context.settings
    if not settings.sql_database:
        raise ToolError("no database is configured ([tools] sql_database)")
    return await asyncio.to_thread(
        run_query, settings.sql_database, arguments["query"],
        timeout=settings.sql_timeout, max_rows=settings.sql_max_rows,
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
