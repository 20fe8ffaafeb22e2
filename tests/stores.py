"""Reading a test's store directly, the same way on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from replay.store import TrajectoryStore


async def rows(store: TrajectoryStore, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """The rows of a query (in the repositories' spelling: ``?`` placeholders) as plain tuples."""
    return [tuple(r.values()) for r in await store._select(sql, args)]
