"""What a selection of trajectories looks like: counts, success, tool-call validity, steps, tokens.

Everything is computed in SQL over the selection (aggregates and window functions), so a store of a
million trajectories is summarised without loading it: memory stays flat, and the read connection never
writes. Percentiles are nearest-rank (p95 = the value at rank ceil(0.95 n) in ascending order).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from replay.filters import Filters
from replay.vocabulary import COMPLETED

# The breakdown key: a trajectory's requested model and adapter ("" when none).
_GROUP = ["COALESCE(t.requested_model, t.base_model, '')", "COALESCE(t.adapter, '')"]


def _p95(conn: sqlite3.Connection, column: str, where: str, args: list[Any],
         by: list[str] | None = None) -> dict[tuple[Any, ...], float]:
    """Nearest-rank p95 of ``column`` per key of the ``by`` expressions (one key, ``()``, without)."""
    by = by or []
    keys = [f"k{i}" for i in range(len(by))]
    partition = f"PARTITION BY {', '.join(by)}" if by else ""
    select_keys = "".join(f"{expr} AS {k}, " for expr, k in zip(by, keys, strict=True))
    sql = f"""
        SELECT {''.join(k + ', ' for k in keys)} v FROM (
            SELECT {select_keys}{column} AS v,
                   ROW_NUMBER() OVER ({partition} ORDER BY {column}) AS rn,
                   COUNT(*) OVER ({partition}) AS n
            FROM trajectories t WHERE {where})
        WHERE rn = (n * 95 + 99) / 100"""
    return {tuple(row[:-1]): row[-1] for row in conn.execute(sql, args)}


def _rate(part: int | None, whole: int | None) -> float | None:
    return round(part / whole, 4) if whole else None


def compute(conn: sqlite3.Connection, filters: Filters) -> dict[str, Any]:
    """The summary of the trajectories ``filters`` selects, as plain JSON-ready values.

    All queries read one snapshot, so the figures agree with each other even while the gateway writes.
    """
    started = not conn.in_transaction
    if started:
        conn.execute("BEGIN")
    try:
        return _compute(conn, filters)
    finally:
        if started and conn.in_transaction:
            conn.execute("COMMIT")


def _compute(conn: sqlite3.Connection, filters: Filters) -> dict[str, Any]:
    where, args = filters.where("t")
    total, completed, calls_total, mean_steps, mean_tokens, prompt, completion, rewarded, mean_reward = conn.execute(
        f"""SELECT COUNT(*), SUM(t.status = '{COMPLETED}'), SUM(t.n_calls), AVG(t.n_calls),
                   AVG(t.prompt_tokens + t.completion_tokens), SUM(t.prompt_tokens), SUM(t.completion_tokens),
                   COUNT(t.final_reward), AVG(t.final_reward)
            FROM trajectories t WHERE {where}""", args).fetchone()
    out: dict[str, Any] = {"filters": {k: v for k, v in vars(filters).items() if v is not None},
                           "trajectories": total}
    if not total:
        return out
    by_status = dict(conn.execute(
        f"SELECT t.status, COUNT(*) FROM trajectories t WHERE {where} GROUP BY 1 ORDER BY 2 DESC", args))
    reasons = dict(conn.execute(
        f"""SELECT t.termination_reason, COUNT(*) FROM trajectories t
            WHERE {where} AND t.termination_reason IS NOT NULL GROUP BY 1 ORDER BY 2 DESC""", args))
    sources = dict(conn.execute(
        f"SELECT t.source, COUNT(*) FROM trajectories t WHERE {where} GROUP BY 1 ORDER BY 2 DESC", args))
    call_status = dict(conn.execute(
        f"""SELECT mc.status, COUNT(*) FROM model_calls mc JOIN trajectories t ON t.id = mc.trajectory_id
            WHERE {where} GROUP BY 1 ORDER BY 2 DESC""", args))
    tool_total, tool_valid = conn.execute(
        f"""SELECT COUNT(*), SUM(tc.valid) FROM tool_calls tc JOIN trajectories t ON t.id = tc.trajectory_id
            WHERE {where}""", args).fetchone()
    tokens_sql = "t.prompt_tokens + t.completion_tokens"
    out.update({
        "success_rate": _rate(completed, total),
        "by_status": by_status,
        "termination_reasons": reasons,
        "sources": sources,
        "model_calls": {"total": calls_total or 0, "by_status": call_status},
        "tool_calls": {"total": tool_total, "valid": tool_valid or 0, "invalid": tool_total - (tool_valid or 0),
                       "valid_rate": _rate(tool_valid, tool_total),
                       "invalid_rate": _rate(tool_total - (tool_valid or 0), tool_total)},
        "steps": {"mean": round(mean_steps, 3), "p95": _p95(conn, "t.n_calls", where, args).get(())},
        "tokens": {"mean": round(mean_tokens, 1), "p95": _p95(conn, tokens_sql, where, args).get(()),
                   "prompt": prompt, "completion": completion},
        "rewards": {"count": rewarded, "mean": None if mean_reward is None else round(mean_reward, 4)},
        "by_model": _by_model(conn, where, args, tokens_sql),
    })
    return out


def _by_model(conn: sqlite3.Connection, where: str, args: list[Any], tokens_sql: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        f"""SELECT {', '.join(_GROUP)}, COUNT(*), SUM(t.status = '{COMPLETED}'), AVG(t.n_calls), AVG({tokens_sql}),
                   AVG(t.final_reward)
            FROM trajectories t WHERE {where} GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2""", args).fetchall()
    tools = {(m, a): (n, v) for m, a, n, v in conn.execute(
        f"""SELECT {', '.join(_GROUP)}, COUNT(*), SUM(tc.valid)
            FROM tool_calls tc JOIN trajectories t ON t.id = tc.trajectory_id
            WHERE {where} GROUP BY 1, 2""", args)}
    steps_p95 = _p95(conn, "t.n_calls", where, args, _GROUP)
    tokens_p95 = _p95(conn, tokens_sql, where, args, _GROUP)
    out = []
    for model, adapter, n, completed, steps, tokens, reward in rows:
        tool_n, tool_valid = tools.get((model, adapter), (0, 0))
        out.append({
            "model": model or None, "adapter": adapter or None, "trajectories": n,
            "success_rate": _rate(completed, n),
            "steps_mean": round(steps, 3), "steps_p95": steps_p95.get((model, adapter)),
            "tokens_mean": round(tokens, 1), "tokens_p95": tokens_p95.get((model, adapter)),
            "tool_calls": tool_n, "valid_tool_call_rate": _rate(tool_valid, tool_n),
            "invalid_tool_call_rate": _rate(tool_n - (tool_valid or 0), tool_n),
            "mean_reward": None if reward is None else round(reward, 4),
        })
    return out
