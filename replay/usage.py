"""Usage reports over the recorded calls: requests, tokens and cost, by key, tenant or model, and by UTC day.

Every figure is a sum over ``model_calls`` (one row per backend call, with the trajectory's key and tenant), so a
report agrees with the calls it counts. A call's cost was priced when it was recorded; calls of unpriced models
count in ``requests`` and tokens but not in ``cost_usd`` (``unpriced_requests`` says how many).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from replay.store import TrajectoryStore

Group = Literal["key", "tenant", "model"]
_GROUPS: dict[str, str] = {"key": "t.key_id", "tenant": "t.tenant", "model": "c.model"}
_DAY = {"sqlite": "strftime('%Y-%m-%d', c.created_at, 'unixepoch')",
        "postgresql": "to_char(to_timestamp(c.created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"}


async def report(store: TrajectoryStore, *, group: Group | None = None, since: float | None = None,
                 until: float | None = None, by_day: bool = False, tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per group (and day): ``requests``, ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
    ``cost_usd`` and ``unpriced_requests``; ``tenant`` limits it to one tenant's calls."""
    keys = [f"{_GROUPS[group]} AS {group}"] if group else []
    if by_day:
        keys.append(f"{_DAY[store.db.dialect]} AS day")
    where: list[str] = ["1 = 1"]
    args: list[Any] = []
    for clause, value in (("c.created_at >= ?", since), ("c.created_at < ?", until), ("t.tenant = ?", tenant)):
        if value is not None:
            where.append(clause)
            args.append(value)
    names = [k.rsplit(" AS ", 1)[1] for k in keys]
    sql = f"""
        SELECT {''.join(k + ', ' for k in keys)}COUNT(*) AS requests,
               COALESCE(SUM(c.prompt_tokens), 0) AS prompt_tokens,
               COALESCE(SUM(c.completion_tokens), 0) AS completion_tokens,
               SUM(c.cost_usd) AS cost_usd, COUNT(*) - COUNT(c.cost_usd) AS unpriced_requests
        FROM model_calls c JOIN trajectories t ON t.id = c.trajectory_id
        WHERE {' AND '.join(where)}
        {('GROUP BY ' + ', '.join(names) + ' ORDER BY ' + ', '.join(names)) if names else ''}"""
    rows = await store._select(sql, args)
    out = []
    for row in rows:
        if not row["requests"]:
            continue  # no calls at all: the ungrouped sum of nothing
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        row["cost_usd"] = round(row["cost_usd"], 10) if row["cost_usd"] is not None else None
        out.append(row)
    return out


def parse_since(text: str, now: float) -> float:
    """A report's start: a UTC date or time (``2026-12-01``, ``2026-12-01T08:00``) or a span back from ``now``
    (``7d``, ``12h``, ``30m``)."""
    text = text.strip()
    units = {"d": 86400, "h": 3600, "m": 60}
    if text[-1:] in units and text[:-1].isdigit():
        return now - int(text[:-1]) * units[text[-1]]
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a UTC date or time (2026-12-01, 2026-12-01T08:00) nor a span "
                         "(7d, 12h, 30m)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
