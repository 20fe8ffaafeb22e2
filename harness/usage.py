"""``harness usage``: requests, tokens and cost from the recorded calls, by key, tenant or model, and by day."""

from __future__ import annotations

import time

import orjson
import typer
from rich.console import Console
from rich.table import Table

from harness.support import ConfigOption, JsonOption, fail, settings_or_exit, with_store
from replay.usage import Group, parse_since, report

console = Console()


def usage(by_key: bool = typer.Option(False, "--key", help="One row per API key."),
          by_tenant: bool = typer.Option(False, "--tenant", help="One row per tenant."),
          by_model: bool = typer.Option(False, "--model", help="One row per base model."),
          since: str | None = typer.Option(None, help="From this UTC date or time (2026-12-01) or span back (7d)."),
          by: str | None = typer.Option(None, "--by", help="'day': one row per UTC day as well."),
          config: str | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """Requests, tokens and cost (at the \\[prices] of when each call was made) of the recorded calls."""
    chosen: list[Group] = [g for g, on in (("key", by_key), ("tenant", by_tenant), ("model", by_model)) if on]
    if len(chosen) > 1:
        fail("choose one of --key, --tenant and --model", 2)
    if by not in (None, "day"):
        fail(f"--by takes 'day', not {by!r}", 2)
    try:
        start = parse_since(since, time.time()) if since else None
    except ValueError as exc:
        fail(f"--since: {exc}", 2)
    group = chosen[0] if chosen else None
    rows = with_store(settings_or_exit(config),
                      lambda s: report(s, group=group, since=start, by_day=by == "day"))
    if as_json:
        typer.echo(orjson.dumps(rows).decode())
        return
    columns = ([group] if group else []) + (["day"] if by == "day" else [])
    table = Table(*columns, "requests", "prompt tokens", "completion tokens", "cost (USD)", "unpriced")
    for row in rows:
        cost = row["cost_usd"]
        table.add_row(*[str(row[c]) if row[c] is not None else "" for c in columns], str(row["requests"]),
                      f"{row['prompt_tokens']:,}", f"{row['completion_tokens']:,}",
                      f"{cost:,.6f}" if cost is not None else "", str(row["unpriced_requests"] or ""))
    console.print(table)
