"""The ``harness`` command."""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
import typer
from rich.console import Console
from rich.table import Table

from extras import MissingExtra
from gateway.auth import is_loopback
from gateway.config import ConfigError
from gateway.quotas.pricing import check_key_budgets
from gateway.quotas.settings import unpriced
from harness.adapters import app as adapters_app
from harness.approvals import app as approvals_app
from harness.config import app as config_app
from harness.keys import app as keys_app
from harness.replay import app as replay_app
from harness.store import app as store_app
from harness.support import (
    ConfigOption,
    HostOption,
    PortOption,
    format_time,
    server_flags,
    settings_or_exit,
    with_store,
)
from harness.training import register as register_training_commands
from harness.usage import usage
from replay import keys
from replay.model import Trajectory

T = TypeVar("T")

app = typer.Typer(help="Agent harness: an OpenAI-compatible gateway that records every trajectory.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
traj_app = typer.Typer(help="Captured trajectories.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.command("usage")(usage)
app.add_typer(traj_app, name="trajectories")
app.add_typer(replay_app, name="replay")
app.add_typer(adapters_app, name="adapters")
app.add_typer(approvals_app, name="approvals")
app.add_typer(store_app, name="store")
register_training_commands(app)
app.add_typer(config_app, name="config")

console = Console()


@app.command()
def serve(config: str | None = ConfigOption, host: str | None = HostOption, port: int | None = PortOption) -> None:
    """Start the gateway."""
    from gateway.app import build_app
    from gateway.logging import configure_logging
    from gateway.serving import serve as serve_app

    settings = settings_or_exit(config, server_flags(host, port))
    configure_logging(settings.server.log_format, settings.server.log_level)
    if not is_loopback(settings.server.host):
        if not with_store(settings, keys.ever_created):
            typer.echo(f"error: refusing to bind {settings.server.host}: no API key was ever created, so no request "
                       "could be let in. Create one with 'harness keys create --tenant NAME' or bind 127.0.0.1.",
                       err=True)
            raise typer.Exit(2)
    try:
        missing = unpriced(settings.backends, settings.prices)
        if missing:  # keys' own budgets in money are read only when some model could not count them
            with_store(settings, lambda s: check_key_budgets(s, missing))
        application = build_app(settings)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    serve_app(settings, application)


@app.command("run")
def run_agent(profile: str = typer.Argument(..., help="An agent profile from the config."),
              task: str = typer.Argument(..., help="What the agent should do."),
              config: str | None = ConfigOption,
              as_json: bool = typer.Option(False, "--json", help="Print the final state as JSON.")) -> None:
    """Run an agent profile to completion here, printing each step as it happens."""
    from gateway.agent.loop import EXECUTE, FINAL, OBSERVE, TERMINATED, StepEvent
    from gateway.app import Gateway
    from gateway.auth import Principal
    from gateway.errors import APIError
    from gateway.logging import configure_logging

    settings = settings_or_exit(config)
    configure_logging("console", "warning")

    def show(event: StepEvent) -> None:
        if event.state == EXECUTE:
            for c in event.data.get("calls", []):
                args = orjson.dumps(c["arguments"]).decode()
                console.print(f"[dim]step {event.step}[/dim] → [cyan]{c['name']}[/cyan]({args})", highlight=False)
        elif event.state == OBSERVE:
            for r in event.data.get("results", []):
                colour = "green" if r["status"] == "ok" else "red"
                console.print(f"   ← [{colour}]{r['status']}[/{colour}] {r['output'][:200]}", highlight=False)
        elif event.state == TERMINATED:
            console.print(f"[yellow]stopped: {event.data.get('reason')}[/yellow] {event.data.get('detail', '')}")
        elif event.state == FINAL:
            console.print("[dim]final answer[/dim]")

    async def main() -> Any:
        gateway = Gateway(settings)
        await gateway.start()
        try:
            loop, recorder = gateway.agents.prepare(profile, [{"role": "user", "content": task}],
                                                    Principal(key_id="cli", tenant=None), on_event=show)
            await recorder.start(loop.state)
            return await loop.run()
        finally:
            await gateway.stop()

    try:
        state = asyncio.run(main())
    except (APIError, ConfigError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(orjson.dumps(state.to_dict()).decode())
    else:
        console.print(state.final or "", highlight=False, markup=False)
        h = state.harness()
        console.print(f"[dim]{h['status']} · {h['steps']} steps · {h['tool_calls']} tool calls "
                      f"({h['invalid_tool_calls']} invalid) · {h['usage']['total_tokens']} tokens · "
                      f"trajectory {h['trajectory_id']}[/dim]")
    if state.status not in ("completed", "terminated"):
        raise typer.Exit(1)


@traj_app.command("list")
def trajectories_list(config: str | None = ConfigOption,
                      limit: int = typer.Option(20, min=1, max=10_000),
                      tenant: str | None = typer.Option(None, help="Only this tenant's."),
                      as_json: bool = typer.Option(False, "--json")) -> None:
    """The newest trajectories first."""
    rows = with_store(settings_or_exit(config), lambda s: s.list_trajectories(
        tenant=tenant, all_tenants=tenant is None, limit=limit))
    if as_json:
        typer.echo(orjson.dumps([t.summary() for t in rows]).decode())
        return
    table = Table("created", "source", "tenant", "model", "status", "calls", "msgs", "tokens", "parent")
    table.add_column("id", no_wrap=True)
    for t in rows:
        table.add_row(format_time(t.created_at), t.source, t.tenant or "", t.requested_model or "", t.status,
                      str(t.n_calls), str(t.message_count), str(t.prompt_tokens + t.completion_tokens),
                      t.parent_id or "", t.id)
    console.print(table)


@traj_app.command("show")
def trajectories_show(trajectory_id: str, config: str | None = ConfigOption,
                      as_json: bool = typer.Option(False, "--json")) -> None:
    """One trajectory as a readable timeline (or its full record with --json)."""
    found = with_store(settings_or_exit(config), lambda s: s.get_trajectory(trajectory_id, all_tenants=True))
    if found is None:
        typer.echo(f"error: no trajectory {trajectory_id}", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(orjson.dumps(found.to_dict(), option=orjson.OPT_INDENT_2).decode())
        return
    _print_timeline(found)


def _print_timeline(t: Trajectory) -> None:
    console.print(f"[bold]trajectory {t.id}[/bold]  {t.status}  model={t.requested_model}  "
                  f"tenant={t.tenant or '-'}  calls={t.n_calls}  parent={t.parent_id or '-'}")
    seen = 0
    for call in t.calls:
        console.print(f"\n[dim]── call {call.seq} · {format_time(call.created_at)} · {call.backend} · "
                      f"{call.status} · {call.latency_ms or 0:.0f} ms · "
                      f"{call.prompt_tokens}+{call.completion_tokens} tokens[/dim]")
        messages = call.messages
        # Clients resend the history; show only what is new since the previous call.
        for m in messages[seen:]:
            _print_message(m)
        seen = len(messages)
        for choice in (call.response or {}).get("choices", []):
            if choice.get("message"):
                _print_message(choice["message"], suffix=f" ({choice.get('finish_reason')})")
                seen += 1 if choice.get("index", 0) == 0 else 0
        if call.error:
            console.print(f"[red]error:[/red] {call.error}")


def _print_message(m: dict[str, Any], suffix: str = "") -> None:
    content = m.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    console.print(f"[cyan]{m.get('role')}[/cyan]{suffix}: {content or ''}", markup=True, highlight=False)
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        console.print(f"   → {fn.get('name')}({fn.get('arguments')})  [dim]{call.get('id')}[/dim]")


@traj_app.command("delete")
def trajectories_delete(trajectory_id: str | None = typer.Argument(None),
                        before: str | None = typer.Option(None, help="Delete all created before this date "
                                                             "(ISO 8601, e.g. 2026-01-31)."),
                        config: str | None = ConfigOption) -> None:
    """Delete one trajectory, or all older than a date."""
    if (trajectory_id is None) == (before is None):
        typer.echo("error: give a trajectory id or --before DATE (not both)", err=True)
        raise typer.Exit(2)
    settings = settings_or_exit(config)
    if before is not None:
        try:
            when = datetime.fromisoformat(before)
        except ValueError:
            typer.echo(f"error: --before {before!r} is not an ISO 8601 date", err=True)
            raise typer.Exit(2) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        count = with_store(settings, lambda s: s.delete(before=when.timestamp()))
    else:
        count = with_store(settings, lambda s: s.delete(ids=[trajectory_id]))  # type: ignore[list-item]
        if count == 0:
            typer.echo(f"error: no trajectory {trajectory_id}", err=True)
            raise typer.Exit(1)
    typer.echo(f"deleted {count} trajectories")


def main() -> None:
    """The ``harness`` command: a feature whose optional extra is missing ends in one line, not a traceback."""
    try:
        app()
    except MissingExtra as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
