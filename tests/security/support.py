"""What the security tests share: reading back what a real gateway stored."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def stored_calls(db: Path, trajectory_id: str) -> int:
    """How many model calls the store holds for one trajectory."""
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM model_calls WHERE trajectory_id = ?", (trajectory_id,)).fetchone()[0]
