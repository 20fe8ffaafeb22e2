"""One set of trajectory filters, the same names on every replay command and in the Python API."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any


def parse_time(value: str | float | None) -> float | None:
    """An ISO 8601 date or time (UTC unless it says otherwise), or unix seconds."""
    if value is None or isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except ValueError:
        pass
    when = datetime.fromisoformat(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


@dataclass(frozen=True)
class Filters:
    """Every field is optional; set ones combine with AND. Times are ISO 8601 or unix seconds."""

    since: str | float | None = None  # created at or after
    until: str | float | None = None  # created before
    source: str | None = None  # proxy | agent | bot | rollout | eval | demo
    model: str | None = None  # the requested model (or its base model)
    adapter: str | None = None
    status: str | None = None  # completed | terminated | error | client_disconnected | interrupted | ...
    reason: str | None = None  # termination reason
    min_reward: float | None = None
    max_reward: float | None = None
    task: str | None = None
    group: str | None = None
    parent: str | None = None  # forks of this trajectory
    tenant: str | None = None
    ids: tuple[str, ...] | None = None  # these trajectories only (the Python API: e.g. the episodes a round kept)

    def where(self, alias: str = "t") -> tuple[str, list[Any]]:
        """A SQL condition over the ``trajectories`` table (as ``alias``) and its arguments."""
        p = f"{alias}."
        clauses: list[str] = []
        args: list[Any] = []

        def add(sql: str, *values: Any) -> None:
            clauses.append(sql)
            args.extend(values)

        if self.since is not None:
            add(f"{p}created_at >= ?", parse_time(self.since))
        if self.until is not None:
            add(f"{p}created_at < ?", parse_time(self.until))
        if self.source is not None:
            add(f"{p}source = ?", self.source)
        if self.model is not None:
            add(f"({p}requested_model = ? OR {p}base_model = ?)", self.model, self.model)
        if self.adapter is not None:
            add(f"{p}adapter = ?", self.adapter)
        if self.status is not None:
            add(f"{p}status = ?", self.status)
        if self.reason is not None:
            add(f"{p}termination_reason = ?", self.reason)
        if self.min_reward is not None:
            add(f"{p}final_reward >= ?", self.min_reward)
        if self.max_reward is not None:
            add(f"{p}final_reward <= ?", self.max_reward)
        if self.task is not None:
            add(f"{p}task_id = ?", self.task)
        if self.group is not None:
            add(f"{p}group_id = ?", self.group)
        if self.parent is not None:
            add(f"{p}parent_id = ?", self.parent)
        if self.tenant is not None:
            add(f"{p}tenant = ?", self.tenant)
        if self.ids is not None:
            add(f"{p}id IN ({', '.join('?' * len(self.ids))})" if self.ids else "1 = 0", *self.ids)
        return (" AND ".join(clauses) or "1 = 1"), args

    @classmethod
    def names(cls) -> list[str]:
        """The filters the replay commands offer as flags (every field but ``ids``)."""
        return [f.name for f in fields(cls) if f.name != "ids"]
