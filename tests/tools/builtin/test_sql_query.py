import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gateway.config import ToolsSettings
from tools.builtin import sql_query
from tools.builtin.sql_query import _Worker, build, run_query, worker_pool
from tools.builtin.sql_worker import MIB
from tools.context import ToolContext
from tools.executor import execute
from tools.spec import ToolError


@pytest.fixture
def database(tmp_path: Path) -> str:
    path = tmp_path / "data.db"
    with sqlite3.connect(path) as connection:
        connection.executescript("""
            CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, blob BLOB);
            CREATE INDEX t_name ON t (name);
            INSERT INTO t (name, blob) VALUES ('ada', x'00ff'), ('grace', NULL), ('linus', NULL);
            PRAGMA user_version = 3;
        """)
    connection.close()
    return str(path)


MAX_BYTES = ToolsSettings().sql_max_bytes


def query(database: str, sql: str, *, timeout: float = 5.0, max_rows: int = 100, max_bytes: int = MAX_BYTES) -> dict:
    return run_query(database, sql, timeout=timeout, max_rows=max_rows, max_bytes=max_bytes)


def state(database: str) -> tuple:
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT * FROM t ORDER BY id").fetchall()
        tables = connection.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()
        version = connection.execute("PRAGMA user_version").fetchone()
        journal = connection.execute("PRAGMA journal_mode").fetchone()
    connection.close()
    return rows, tables, version, journal


def test_select_returns_columns_and_rows(database: str) -> None:
    result = query(database, "SELECT id, name FROM t WHERE id <= 2 ORDER BY id")
    assert result == {"columns": ["id", "name"], "rows": [[1, "ada"], [2, "grace"]], "row_count": 2,
                      "truncated": False}


def test_ctes_functions_and_blobs_work(database: str) -> None:
    result = query(database, "WITH n AS (SELECT upper(name) AS u, blob FROM t) SELECT u, blob FROM n LIMIT 1")
    assert result["rows"] == [["ADA", "<blob of 2 bytes>"]]
    recursive = query(database, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5) "
                                "SELECT sum(x) FROM c")
    assert recursive["rows"] == [[15]]


def test_schema_can_be_read(database: str) -> None:
    assert query(database, "SELECT name FROM sqlite_master ORDER BY name")["rows"] == [["t"], ["t_name"]]
    assert [r[1] for r in query(database, "PRAGMA table_info(t)")["rows"]] == ["id", "name", "blob"]


def test_rows_are_capped(database: str) -> None:
    result = query(database, "SELECT id FROM t ORDER BY id", max_rows=2)
    assert result["rows"] == [[1], [2]] and result["row_count"] == 2 and result["truncated"] is True


@pytest.mark.parametrize("sql", [
    "WITH x AS (SELECT 1) INSERT INTO t (id) SELECT * FROM x",
    "INSERT INTO t (name) VALUES ('eve')",
    "UPDATE t SET name = 'eve'",
    "DELETE FROM t",
    "DROP TABLE t",
    "CREATE TABLE u (x)",
    "CREATE TEMP TABLE u (x)",
    "CREATE INDEX i ON t (name)",
    "ALTER TABLE t ADD COLUMN y",
    "ATTACH DATABASE ':memory:' AS other",
    "DETACH DATABASE main",
    "PRAGMA journal_mode=DELETE",
    "PRAGMA user_version=5",
    "PRAGMA writable_schema=ON",
    "BEGIN",
    "VACUUM",
    "REINDEX",
    "ANALYZE",
    "SELECT load_extension('x')",
])
def test_everything_but_reading_is_refused(database: str, sql: str) -> None:
    before = state(database)
    with pytest.raises(ToolError, match="only reading is allowed|readonly|read-only|not authorized"):
        query(database, sql)
    assert state(database) == before


def test_refusal_names_the_action(database: str) -> None:
    with pytest.raises(ToolError, match="only reading is allowed; refused: INSERT"):
        query(database, "WITH x AS (SELECT 1) INSERT INTO t (id) SELECT * FROM x")
    with pytest.raises(ToolError, match="refused: PRAGMA user_version"):
        query(database, "PRAGMA user_version=5")
    with pytest.raises(ToolError, match="refused: FUNCTION load_extension$"):
        query(database, "SELECT load_extension('x')")


@pytest.mark.parametrize("sql", [
    "SELECT hex(fts3_tokenizer('simple'))",  # a native pointer: where the library lies in memory
    "SELECT fts5(NULL)",
    "SELECT sqlite_log(1, 'x')",
    "SELECT rtreenode(2, x'00')",
])
def test_only_allow_listed_functions_run(database: str, sql: str) -> None:
    name = sql.split("(")[1].split()[-1] if sql.startswith("SELECT hex") else sql.split()[1].split("(")[0]
    with pytest.raises(ToolError, match=f"refused: FUNCTION {name}"):
        query(database, sql)


def test_everyday_functions_are_allowed(database: str) -> None:
    result = query(database, """SELECT abs(-1), upper(name), json_extract('{"a": 2}', '$.a'), '{"b": 3}' ->> 'b',
        date('2026-01-02'), round(pi(), 2), row_number() OVER (ORDER BY id), count(*) OVER (), coalesce(NULL, 1),
        printf('%05d', id), group_concat(name) OVER () FROM t WHERE id = 1""")
    assert result["rows"] == [[1, "ADA", 2, 3, "2026-01-02", 3.14, 1, 1, 1, "00001", "ada"]]


def test_a_huge_value_fails_at_once(database: str) -> None:
    started = time.monotonic()
    for sql in ("SELECT length(randomblob(900000000))", "SELECT length(zeroblob(2000000))",
                "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100000) "
                "SELECT length(group_concat(printf('%100d', x))) FROM c"):
        with pytest.raises(ToolError, match=f"exceed the limit of {MAX_BYTES} bytes"):
            query(database, sql)
    assert time.monotonic() - started < 2


def test_fetching_stops_at_the_byte_limit(database: str) -> None:
    # 1.3 GB of blobs asked for, 100 kB each: only what fits in the limit is fetched.
    result = query(database, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 13000) "
                             "SELECT x, zeroblob(100000) FROM c")
    assert result["truncated"] is True and result["row_count"] == MAX_BYTES // 100_008


def _peak_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024


ATTACKS = [
    "SELECT length(randomblob(900000000))",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 13000) SELECT x, zeroblob(100000) FROM c",
    f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5000) "
    f"SELECT sum(length(zeroblob({MAX_BYTES}))) FROM c",
    f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000) "
    f"SELECT x, randomblob({MAX_BYTES - 100}) FROM c ORDER BY random()",
]
# Aggregates that grow past the value limit before they check it (issue 40, finding 4), and a row of values each
# within the limit whose copies in Python would pass the heap limit: the address-space limit stops those.
MEMORY_ATTACKS = [
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 100000) "
    "SELECT length(json_group_array(hex(zeroblob(131000)))) FROM c",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 100000) "
    "SELECT length(json_group_object(x, hex(zeroblob(131000)))) FROM c",
    "SELECT " + ", ".join(["randomblob(262000)"] * 450),
]


def test_the_workers_memory_stays_bounded(database: str) -> None:
    # The worker's peak is reset once it is up (writing 5 to clear_refs resets VmHWM), so only what the queries
    # add counts. Everyday attacks stay small; the memory attacks stop at the limits.
    max_memory = ToolsSettings().sql_max_memory_mb
    request = {"database": database, "timeout": 5, "max_rows": 200, "max_bytes": MAX_BYTES}
    worker = _Worker(max_memory * MIB)
    try:
        worker.ask({**request, "query": "SELECT 1"}, time.monotonic() + 10, MIB)
        Path(f"/proc/{worker.proc.pid}/clear_refs").write_text("5")
        idle = _peak_mb(worker.proc.pid)
        for sql in ATTACKS:
            worker.ask({**request, "query": sql}, time.monotonic() + 10, 64 * MIB)
        grown = _peak_mb(worker.proc.pid) - idle
        assert grown < 50, f"the worker's peak grew above idle by {grown:.0f} MB"
    finally:
        worker.close()
    for sql in MEMORY_ATTACKS:
        worker = _Worker(max_memory * MIB)
        try:
            reply = worker.ask({**request, "query": sql}, time.monotonic() + 10, MIB)
            assert f"needs more than {max_memory} MiB" in reply["error"] and reply["recycle"] is True
            # The address-space limit: the heap limit, the room left for Python and the worker's own size.
            limits = Path(f"/proc/{worker.proc.pid}/limits").read_text()
            bound = int(next(line for line in limits.splitlines() if line.startswith("Max address space")).split()[3])
            assert bound / MIB < max_memory + 64 + 8 * MAX_BYTES / MIB + 64
            assert _peak_mb(worker.proc.pid) <= bound / MIB, sql[:60]
        finally:
            worker.close()


def test_aggregates_fail_on_the_memory_limit_at_once(database: str) -> None:
    started = time.monotonic()
    for sql in MEMORY_ATTACKS:
        with pytest.raises(ToolError, match="the query needs more than 128 MiB of memory"):
            query(database, sql)
    assert time.monotonic() - started < 3
    # The limit is a setting, and the tool goes on working on a fresh worker.
    with pytest.raises(ToolError, match="the query needs more than 32 MiB of memory"):
        run_query(database, MEMORY_ATTACKS[0], timeout=5, max_rows=10, max_bytes=MAX_BYTES, max_memory_mb=32)
    assert query(database, "SELECT count(*) FROM t")["rows"] == [[3]]


def test_the_memory_limit_must_leave_room_for_the_value_limit() -> None:
    with pytest.raises(ValueError, match="sql_max_memory_mb = 128 is too small for sql_max_bytes = 100000000"):
        ToolsSettings(sql_max_bytes=100_000_000)
    assert ToolsSettings(sql_max_bytes=100_000_000, sql_max_memory_mb=400).sql_max_memory_mb == 400


def test_a_killed_worker_is_replaced(database: str) -> None:
    pool = worker_pool(1, 64 * MIB)
    run_query(database, "SELECT 1", timeout=5, max_rows=10, max_bytes=MAX_BYTES, max_memory_mb=64, workers=1)
    [worker] = pool._idle
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    threading.Timer(0.3, worker.proc.kill).start()
    with pytest.raises(ToolError, match=r"worker process stopped \(it was killed by signal 9\); it may have needed "
                                        "more than 64 MiB"):
        run_query(database, endless, timeout=5, max_rows=10, max_bytes=MAX_BYTES, max_memory_mb=64, workers=1)
    assert run_query(database, "SELECT 2", timeout=5, max_rows=10, max_bytes=MAX_BYTES, max_memory_mb=64,
                     workers=1)["rows"] == [[2]]
    # A worker stopped while idle is noticed before it is given a query.
    [worker] = pool._idle
    worker.proc.kill()
    worker.proc.wait()
    assert query(database, "SELECT 3")["rows"] == [[3]]


def test_a_stuck_worker_is_killed_at_the_deadline(database: str) -> None:
    pool = worker_pool(1, 48 * MIB)
    args = {"timeout": 0.2, "max_rows": 10, "max_bytes": MAX_BYTES, "max_memory_mb": 48, "workers": 1}
    run_query(database, "SELECT 1", **args)
    [worker] = pool._idle
    os.kill(worker.proc.pid, signal.SIGSTOP)  # it can no longer interrupt itself
    started = time.monotonic()
    with pytest.raises(ToolError, match="ran longer than its limit of 0.2s"):
        run_query(database, "SELECT 1", **args)
    assert time.monotonic() - started < 0.2 + sql_query._GRACE + 1
    assert worker.proc.poll() is not None and pool._idle == []
    assert run_query(database, "SELECT 4", **args)["rows"] == [[4]]


def test_concurrency_is_bounded(database: str) -> None:
    args = {"max_rows": 10, "max_bytes": MAX_BYTES, "max_memory_mb": 40, "workers": 1}
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    outcome: list[str] = []

    def run_slow() -> None:
        try:
            run_query(database, slow, timeout=1.5, **args)
        except ToolError as exc:
            outcome.append(str(exc))

    busy = threading.Thread(target=run_slow)
    busy.start()
    time.sleep(0.3)
    with pytest.raises(ToolError, match=r"already running 1 queries \(\[tools\] sql_workers\)"):
        run_query(database, "SELECT 1", timeout=0.3, **args)
    busy.join()
    assert outcome == ["the query ran longer than its limit of 1.5s"]
    assert run_query(database, "SELECT 5", timeout=1, **args)["rows"] == [[5]]


def test_runaway_query_hits_the_time_limit(database: str) -> None:
    with pytest.raises(ToolError, match="ran longer than its limit of 0.3s"):
        query(database, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
              timeout=0.3)


def test_errors_are_plain(database: str) -> None:
    with pytest.raises(ToolError, match="no such table: nope"):
        query(database, "SELECT * FROM nope")
    with pytest.raises(ToolError, match="one statement"):
        query(database, "SELECT 1; SELECT 2")
    with pytest.raises(ToolError, match="does not exist"):
        query(database + ".missing", "SELECT 1")


async def test_through_the_executor(database: str) -> None:
    settings = ToolsSettings(sql_database=database, sql_timeout=0.3)
    spec, context = build(settings), ToolContext(settings)
    outcome = await execute(spec, {"query": "SELECT count(*) AS n FROM t"}, context)
    assert outcome.status == "ok" and '"rows": [[3]]' in outcome.output
    outcome = await execute(spec, {"query": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                            "SELECT max(x) FROM c"}, context)
    assert outcome.status == "error" and "ran longer than its limit" in outcome.output
    outcome = await execute(spec, {"query": "DELETE FROM t"}, context)
    assert outcome.output == "Tool sql_query failed: only reading is allowed; refused: DELETE"


async def test_no_database_configured() -> None:
    outcome = await execute(build(ToolsSettings()), {"query": "SELECT 1"}, ToolContext())
    assert outcome.output == "Tool sql_query failed: no database is configured ([tools] sql_database)"
