"""The stages of a run, timed: each one's wall time and what it processed, printed as it ends and kept.

``stage("build", "411 rows …", rows=411)`` prints the line with the stage's own seconds and the run's so far, and
keeps ``{"stage": "build", "seconds": …, "rows": 411}``; ``table()`` is the summary a run prints at its end and
``records`` what it stores; ``on_stage``, when given, is called with ``records`` after each one (the run's row in
the store follows them so).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table


class Stages:
    def __init__(self, console: Console, on_stage: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.console = console
        self.on_stage = on_stage
        self.started = self.last = time.perf_counter()
        self.records: list[dict[str, Any]] = []

    def __call__(self, label: str, detail: str, **counts: int) -> None:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.records.append({"stage": label, "seconds": round(seconds, 2), **counts})
        self.console.print(f"[bold]{label:<9}[/bold] {detail}  [dim]({seconds:.0f} s; {now - self.started:.0f} s "
                           "in all)[/dim]")
        if self.on_stage is not None:
            self.on_stage(self.records)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.started

    def table(self) -> Table:
        table = Table(title=f"stages: {self.total:.0f} s in all")
        table.add_column("stage")
        table.add_column("seconds", justify="right")
        table.add_column("share", justify="right")
        table.add_column("processed")
        for record in self.records:
            counts = ", ".join(f"{value:,} {name}" for name, value in record.items()
                               if name not in ("stage", "seconds"))
            table.add_row(record["stage"], f"{record['seconds']:.0f}", f"{record['seconds'] / self.total:.0%}",
                          counts)
        return table
