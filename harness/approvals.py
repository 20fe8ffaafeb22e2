"""``harness approvals``: tool calls waiting for a person, and the decisions on them.

Without ``--gateway`` a decision is written to the configured store and the running gateway carries the run on at
its next sweep (``[tools] approval_poll_seconds``). With ``--gateway URL`` the gateway's admin routes are called
(admin key from ``HARNESS_ADMIN_KEY``) and the run goes on at once.
"""

from __future__ import annotations

import getpass
import time
from typing import Any

import orjson
import typer
from rich.console import Console
from rich.table import Table

from harness.support import (
    ConfigOption,
    GatewayOption,
    JsonOption,
    call_gateway,
    fail,
    format_time,
    settings_or_exit,
    with_store,
)
from replay import approvals

app = typer.Typer(help="Tool calls waiting for a person's approval.", no_args_is_help=True)
console = Console()

StatusOption = typer.Option("pending", help="pending, approved, denied, expired or all.")


def _arguments(row: dict[str, Any]) -> str:
    text = orjson.dumps(row["arguments"]).decode()
    return text if len(text) <= 120 else text[:117] + "..."


@app.command("list")
def list_approvals(status: str = StatusOption, config: str | None = ConfigOption,
                   gateway: str | None = GatewayOption, as_json: bool = JsonOption) -> None:
    """The held calls (waiting ones by default): tool, arguments, run, and when they expire."""
    if status not in ("pending", "approved", "denied", "expired", "all"):
        fail("--status must be pending, approved, denied, expired or all", 2)
    if gateway:
        rows = call_gateway(gateway, config, "GET", "/admin/approvals", params={"status": status})["data"]
    else:
        rows = with_store(settings_or_exit(config), lambda s: approvals.list_approvals(
            s, status=None if status == "all" else status))
    if as_json:
        typer.echo(orjson.dumps(rows).decode())
        return
    if not rows:
        typer.echo(f"no {'' if status == 'all' else status + ' '}approvals")
        return
    table = Table("id", "tool", "arguments", "run", "profile", "status", "created", "expires")
    for r in rows:
        table.add_row(r["id"], r["tool"], _arguments(r), r["trajectory_id"], r["profile"], r["status"],
                      format_time(r["created_at"]), format_time(r["expires_at"]))
    console.print(table)


def _decide(approval_id: str, approve: bool, reason: str | None, config: str | None, gateway: str | None,
            as_json: bool) -> None:
    by = getpass.getuser()
    if gateway:
        decision = "approve" if approve else "deny"
        row = call_gateway(gateway, config, "POST", f"/admin/approvals/{approval_id}/{decision}",
                           json={"reason": reason, "by": by})
    else:
        row, changed = with_store(settings_or_exit(config), lambda s: approvals.decide(
            s, approval_id, approve=approve, reason=reason, by=by, now=time.time()))
        if row is None:
            fail(f"no approval {approval_id}")
        if not changed:
            fail(approvals.refusal(row))
    if as_json:
        typer.echo(orjson.dumps(row).decode())
        return
    later = "" if gateway else " (the gateway carries the run on at its next sweep)"
    typer.echo(f"{row['status']} {row['tool']} {_arguments(row)} for run {row['trajectory_id']}{later}")


@app.command("approve")
def approve(approval_id: str, config: str | None = ConfigOption, gateway: str | None = GatewayOption,
            as_json: bool = JsonOption) -> None:
    """Let the held call run; the agent goes on with its result."""
    _decide(approval_id, True, None, config, gateway, as_json)


@app.command("deny")
def deny(approval_id: str, reason: str | None = typer.Option(None, help="Told to the model with the denial."),
         config: str | None = ConfigOption, gateway: str | None = GatewayOption, as_json: bool = JsonOption) -> None:
    """Refuse the held call; the agent is told so and goes on without it."""
    _decide(approval_id, False, reason, config, gateway, as_json)
