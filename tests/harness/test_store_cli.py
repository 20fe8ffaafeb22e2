"""``harness store migrate`` through the CLI: the comparison it prints, one ``error:`` line for whatever goes wrong,
and a run killed with SIGKILL that resumes when run again."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from harness.main import app
from replay.copying import tables
from tests.postgres import PostgresServer
from tests.processes import ROOT
from tests.replay.whole_store import build, counts

runner = CliRunner()


def migrate(*args: str) -> Any:
    return runner.invoke(app, ["store", "migrate", *args], catch_exceptions=False)


async def test_migrate_prints_every_table_the_same(tmp_path: Path, postgres: PostgresServer) -> None:
    src = tmp_path / "src.db"
    await build(src)
    url = postgres.database()
    result = migrate(str(src), url)
    assert result.exit_code == 0, result.output
    for table in tables():
        assert re.search(rf"{table.name}\s.*\ssame\b", result.stdout), result.stdout
    assert "DIFFERS" not in result.stdout
    assert re.search(r"copied [\d,]+ rows \([\d,]+ new\) in [\d.]+ s \([\d,]+ rows/s\)", result.stderr)

    back = tmp_path / "back.db"
    assert migrate(url, str(back)).exit_code == 0
    assert migrate(str(src), str(back), "--verify-only").exit_code == 0


async def test_a_difference_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.db", tmp_path / "dst.db"
    await build(src)
    assert migrate(str(src), str(dst)).exit_code == 0
    conn = sqlite3.connect(dst)
    with conn:
        conn.execute("UPDATE feedback SET value = value + 1 WHERE id = (SELECT MIN(id) FROM feedback)")
    conn.close()
    result = migrate(str(src), str(dst), "--verify-only")
    assert result.exit_code == 1
    assert re.search(r"feedback\s.*DIFFERS", result.stdout)
    error = result.stderr.strip()
    assert error.startswith("error: DST differs from SRC in 1 table(s): feedback (") and "row id=" in error
    assert "\n" not in error


@pytest.mark.parametrize(("args", "code", "message"), [
    (("{src}", "{src}"), 2, "SRC and DST are the same store"),
    (("{tmp}/none.db", "{tmp}/dst.db"), 1, "no store at"),
    (("{src}", "{tmp}/no-such-dir/dst.db"), 1, "no directory"),
    (("postgresql://harness:hunter2@127.0.0.1:1/x", "{tmp}/dst.db"), 1,
     "cannot connect to the store at postgresql://harness:***@127.0.0.1:1/x"),
    (("postgresql://harness:hunter2@[::1/x", "{tmp}/dst.db"), 1, "cannot connect to the store at "),
    (("{src}", "{tmp}/dst.db", "--chunk-rows", "0"), 2, "--chunk-rows"),
])
async def test_bad_input_gets_a_clear_message(tmp_path: Path, args: tuple[str, ...], code: int,
                                              message: str) -> None:
    src = tmp_path / "src.db"
    await build(src, agents=1)
    result = migrate(*(a.format(src=src, tmp=tmp_path) for a in args))
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output and "hunter2" not in result.output


async def test_a_run_killed_mid_copy_resumes_when_run_again(tmp_path: Path, postgres: PostgresServer) -> None:
    src = tmp_path / "src.db"
    await build(src, agents=150)
    url = postgres.database()
    total = counts(str(src))
    command = [sys.executable, "-m", "harness.main", "store", "migrate", str(src), url, "--chunk-rows", "1"]
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while counts(url)["model_calls"] < 50 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, "the copy finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
    held = counts(url)
    assert 0 < sum(held.values()) < sum(total.values())

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    remaining = sum(total.values()) - sum(held.values())
    # the rerun read only what the killed run had not committed, and all of it was new
    assert f"copied {remaining:,} rows ({remaining:,} new)" in again.stderr
    assert counts(url) == total
