"""``harness replay`` end to end through the CLI: read commands never touch the store, bad input gets a
clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from harness.main import app
from replay.importer import build_op, read_file
from replay.schema import SCHEMA_VERSION
from replay.writer import RecordRejected
from tests.replay import builders as b

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HARNESS_CONFIG", raising=False)
    for key in [k for k in os.environ if k.startswith("HARNESS_STORE__")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def replay(*args: str) -> Any:
    # catch_exceptions=False: an unexpected exception fails the test instead of hiding as an exit code.
    return runner.invoke(app, ["replay", *args], catch_exceptions=False)


@pytest.fixture
async def db(tmp_path: Path) -> Path:
    path = tmp_path / "h.db"
    store = await b.open_store(path)
    await b.agent_trajectory(store, "q1", source="agent", model="m1", status="completed",
                             tool_rows=[[b.tool_row("call_1", True)], []])
    await b.agent_trajectory(store, "q2", source="agent", model="m1", adapter="lora", status="terminated",
                             reason="max_steps", reward=0.25, tool_rows=[[b.tool_row("call_1", False)], []])
    await b.agent_trajectory(store, "q3", source="proxy", model="m2", tenant="acme", reward=1.0)
    await store.close()
    return path


def test_stats_json_and_table(db: Path) -> None:
    result = replay("stats", "--store", str(db), "--json")
    assert result.exit_code == 0, result.output
    s = orjson.loads(result.stdout)
    assert s["trajectories"] == 3 and s["success_rate"] == round(2 / 3, 4)
    assert s["by_status"] == {"completed": 2, "terminated": 1} and s["termination_reasons"] == {"max_steps": 1}
    assert s["tool_calls"] == {"total": 2, "valid": 1, "invalid": 1, "valid_rate": 0.5, "invalid_rate": 0.5}
    assert s["steps"] == {"mean": 2.0, "p95": 2} and s["model_calls"]["total"] == 6
    assert s["tokens"]["p95"] == 40 and s["rewards"] == {"count": 2, "mean": 0.625}
    assert [(m["model"], m["adapter"], m["trajectories"]) for m in s["by_model"]] == [
        ("m1", None, 1), ("m1", "lora", 1), ("m2", None, 1)]
    lora = s["by_model"][1]
    assert lora["invalid_tool_call_rate"] == 1.0 and lora["success_rate"] == 0.0
    filtered = orjson.loads(replay("stats", "--store", str(db), "--json", "--source", "agent",
                                   "--max-reward", "0.5").stdout)
    assert filtered["trajectories"] == 1 and filtered["filters"] == {"source": "agent", "max_reward": 0.5}
    table = replay("stats", "--store", str(db))
    assert table.exit_code == 0 and "By model / adapter" in table.stdout and "max_steps" in table.stdout


def test_empty_selections(db: Path, tmp_path: Path) -> None:
    result = replay("stats", "--store", str(db), "--task", "nothing")
    assert result.exit_code == 0 and "no trajectories match" in result.stderr
    out = tmp_path / "rows.jsonl"
    result = replay("export", "--store", str(db), "-f", "chat-jsonl", "-o", str(out), "--tenant", "nobody")
    assert result.exit_code == 1 and "no trajectories match" in result.stderr
    assert not out.exists()


@pytest.mark.extra("train")
def test_read_commands_leave_the_store_byte_identical(db: Path, tmp_path: Path) -> None:
    before, mtime = b.digest(db), db.stat().st_mtime_ns
    assert b.side_files(db) == []
    assert replay("stats", "--store", str(db), "--json").exit_code == 0
    assert replay("export", "--store", str(db), "-f", "chat-jsonl", "-o", str(tmp_path / "a.jsonl")).exit_code == 0
    assert replay("export", "--store", str(db), "-f", "hf", "-o", str(tmp_path / "ds"), "--window", "0").exit_code == 0
    assert b.digest(db) == before and db.stat().st_mtime_ns == mtime
    assert b.side_files(db) == []  # no -wal or -shm left behind


async def test_reading_beside_a_live_writer(db: Path, tmp_path: Path) -> None:
    store = await b.open_store(db)
    try:
        tid = await b.agent_trajectory(store, "written while the gateway runs")
        files = {name: b.digest(tmp_path / name) for name in ["h.db", *b.side_files(db)]}
        assert "h.db-wal" in files
        out = tmp_path / "live.jsonl"
        assert replay("export", "--store", str(db), "-f", "chat-jsonl", "-o", str(out)).exit_code == 0
        assert tid in {orjson.loads(line)["trajectory_id"] for line in out.read_bytes().splitlines()}
        assert {name: b.digest(tmp_path / name) for name in files if name != "h.db-shm"} == {
            k: v for k, v in files.items() if k != "h.db-shm"}  # the shm is the lock table readers share
        # The writer is unaffected and goes on writing.
        await b.agent_trajectory(store, "and after")
    finally:
        await store.close()
    assert b.side_files(db) == []


def test_newer_older_and_damaged_stores_are_refused_clearly(db: Path, tmp_path: Path) -> None:
    def refused(path: Path | str, *words: str) -> None:
        for args in (["stats", "--json"], ["export", "-f", "chat-jsonl", "-o", str(tmp_path / "x.jsonl")]):
            result = replay(*args, "--store", str(path))
            assert result.exit_code == 1, result.output
            assert result.stderr.startswith("error: ") and "Traceback" not in result.output
            for word in words:
                assert word in result.stderr
        assert not (tmp_path / "x.jsonl").exists()

    # A PostgreSQL store is read by the gateway and the store commands; these read a file (and say how to get one).
    refused("postgresql://harness:secret@127.0.0.1:1/harness", "is a PostgreSQL store", "harness store migrate",
            "harness:***@")

    newer = tmp_path / "newer.db"
    newer.write_bytes(db.read_bytes())
    with sqlite3.connect(newer) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    refused(newer, "newer than this program knows")
    result = replay("import", str(_demo_file(tmp_path)), "--store", str(newer))
    assert result.exit_code == 1 and "newer than this program knows" in result.stderr
    assert "nothing imported" in result.stderr

    older = tmp_path / "older.db"
    with sqlite3.connect(older) as conn:
        conn.execute("CREATE TABLE trajectories (id TEXT)")
        conn.execute("PRAGMA user_version = 1")
    before = b.digest(older)
    refused(older, "older than this program's", "missing tables", "never migrate")
    assert b.digest(older) == before  # and it was not migrated behind anyone's back

    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(8192))
    refused(junk, "not an SQLite database")
    refused(tmp_path / "missing.db", "no store at")

    damaged = tmp_path / "damaged.db"
    data = bytearray(db.read_bytes())
    page = 4096
    data[page:] = os.urandom(len(data) - page)  # keep the header page, ruin every table page
    damaged.write_bytes(bytes(data))
    refused(damaged)


def _demo_file(tmp_path: Path, bad_line: int | None = None) -> Path:
    rows = [orjson.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
                          "tools": b.TOOLS}).decode() for i in range(4)]
    if bad_line is not None:
        rows[bad_line - 1] = '{"messages": "not a list"}'
    path = tmp_path / f"demo-{bad_line}.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]


def test_import_then_export_through_the_cli(db: Path, tmp_path: Path) -> None:
    result = replay("import", str(_demo_file(tmp_path)), "--store", str(db), "--source", "demo", "--task", "T",
                    "--group", "G", "--tenant", "acme")
    assert result.exit_code == 0, result.output
    assert "imported 4 trajectories (4 model calls)" in result.stderr
    out = tmp_path / "demo-out.jsonl"
    result = replay("export", "--store", str(db), "-f", "chat-jsonl", "-o", str(out), "--source", "demo",
                    "--task", "T", "--group", "G", "--tenant", "acme", "--window", "0")
    assert result.exit_code == 0, result.output
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == ["q0", "q1", "q2", "q3"]
    assert all(r["tools"] == b.TOOLS and r["source"] == "demo" for r in rows)


async def test_import_is_all_or_nothing(db: Path, tmp_path: Path) -> None:
    before = _count(db)
    # The CLI runs its own event loop, so from this async test it runs in a thread.
    result = await asyncio.to_thread(replay, "import", str(_demo_file(tmp_path, bad_line=3)), "--store", str(db))
    assert result.exit_code == 1
    assert "line 3: 'messages' must be a non-empty list" in result.stderr and "nothing imported" in result.stderr
    assert _count(db) == before
    # The whole file is one WriteOp, so one transaction: a failure anywhere in it (here a statement that
    # cannot run, standing for a disk error) leaves nothing of it behind.
    op = build_op(read_file(_demo_file(tmp_path)), source="demo")
    op.statements.append(("INSERT INTO no_such_table VALUES (1)", ()))
    store = await b.open_store(db)
    try:
        with pytest.raises(RecordRejected, match="no_such_table"):
            await store.write(op)
    finally:
        await store.close()
    assert _count(db) == before
    missing = await asyncio.to_thread(replay, "import", str(tmp_path / "nope.jsonl"), "--store", str(db))
    assert missing.exit_code == 1 and "no file" in missing.stderr


def test_bad_arguments_and_outputs(db: Path, tmp_path: Path) -> None:
    export = ["export", "--store", str(db), "-f", "chat-jsonl"]
    result = replay(*export, "-o", str(tmp_path / "no-dir" / "x.jsonl"))
    assert result.exit_code == 1 and "does not exist" in result.stderr
    (tmp_path / "taken.jsonl").write_text("keep me")
    result = replay(*export, "-o", str(tmp_path / "taken.jsonl"))
    assert result.exit_code == 1 and "--force" in result.stderr
    assert (tmp_path / "taken.jsonl").read_text() == "keep me"
    assert replay(*export, "-o", str(tmp_path / "taken.jsonl"), "--force").exit_code == 0
    assert replay(*export, "-o", str(tmp_path / "y.jsonl"), "--since", "last tuesday").exit_code == 2
    assert replay("export", "--store", str(db), "-f", "parquet", "-o", str(tmp_path / "z")).exit_code == 2
    assert replay(*export, "-o", str(tmp_path / "z"), "--redact-pattern", "(").exit_code == 2
    assert replay(*export, "-o", str(tmp_path / "z"), "--no-redact", "--redact-pattern", "x").exit_code == 2
    assert not (tmp_path / "y.jsonl").exists() and not (tmp_path / "z").exists()


def test_redaction_settings_come_from_the_config(db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "harness.toml"
    config.write_text(f'[store]\npath = "{db}"\nredact_patterns = ["q[0-9]"]\n')
    out = tmp_path / "c.jsonl"
    assert replay("export", "-c", str(config), "-f", "chat-jsonl", "-o", str(out)).exit_code == 0
    users = [orjson.loads(line)["messages"][1]["content"] for line in out.read_bytes().splitlines()]
    assert set(users) == {"[REDACTED:custom]"}
    assert replay("export", "-c", str(config), "-f", "chat-jsonl", "-o", str(out), "--force",
                  "--no-redact").exit_code == 0
    assert {orjson.loads(line)["messages"][1]["content"] for line in out.read_bytes().splitlines()} == {
        "q1", "q2", "q3"}
