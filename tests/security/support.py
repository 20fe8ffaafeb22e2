"""What the security tests share: keys of two tenants on a real gateway, and reading back what it stored."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.processes import ROOT


def new_key(config: Path, tenant: str) -> str:
    """A key of ``tenant`` made with ``harness keys create``, as an operator makes one."""
    out = subprocess.run([sys.executable, "-m", "harness.main", "keys", "create", "--tenant", tenant,
                          "--config", str(config)], cwd=config.parent, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    found = re.search(r"key:\s+(sk-harness-\S+)", out.stdout)
    assert found, out.stdout
    return found.group(1)


def stored_calls(db: Path, trajectory_id: str) -> int:
    """How many model calls the store holds for one trajectory."""
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM model_calls WHERE trajectory_id = ?", (trajectory_id,)).fetchone()[0]
