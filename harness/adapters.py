"""``harness adapters``: the registry and lifecycle from the command line.

Without ``--gateway`` the commands change the registry in the configured store, and a running gateway
applies the change at its next refresh (``[routing] refresh_seconds``). With ``--gateway URL`` they call that
gateway's admin routes (admin key from ``HARNESS_ADMIN_KEY``), which load and unload at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson
import typer
from rich.console import Console
from rich.table import Table

from gateway.adapters import archive
from gateway.adapters.service import AdapterService
from gateway.logging import configure_logging
from harness.support import ConfigOption, GatewayOption, JsonOption, call_gateway, fail, settings_or_exit
from replay.adapters import AdapterRegistry, AdapterVersion, RegistryError, parse_ref

T = TypeVar("T")

app = typer.Typer(help="LoRA adapters: register, publish, promote, roll back, retire.", no_args_is_help=True)
console = Console()


@app.callback()
def _quiet() -> None:
    configure_logging("console", "warning")  # stdout is for results (--json), not log lines

PathArgument = typer.Argument(..., help="The adapter folder (adapter_config.json and weights).")


def _local(config: str | None, action: Callable[[AdapterService], Awaitable[T]]) -> T:
    settings = settings_or_exit(config)
    service = AdapterService(AdapterRegistry(settings.store.location), settings.routing.adapters_dir,
                             settings.routing.max_upload_bytes)
    try:
        return asyncio.run(action(service))
    except RegistryError as exc:
        fail(exc.message)


def _show(card: dict[str, Any], as_json: bool, verb: str) -> None:
    if as_json:
        typer.echo(orjson.dumps(card).decode())
        return
    line = f"{verb} {card['name']}@{card['version']} (base {card['base_model']}, {card['status']})"
    if card.get("replaced"):
        line += f", replacing version {card['replaced']}"
    typer.echo(line)


def _card(version: AdapterVersion, **extra: Any) -> dict[str, Any]:
    return {**version.as_dict(), **extra}


def _version_of(ref: str) -> tuple[str, int | None]:
    try:
        return parse_ref(ref)
    except RegistryError as exc:
        fail(exc.message, 2)


def _exact(ref: str) -> tuple[str, int]:
    name, version = _version_of(ref)
    if version is None:
        fail(f"name the version: {name}@N", 2)
    return name, version  # type: ignore[return-value]


@app.command("list")
def list_adapters(config: str | None = ConfigOption, gateway: str | None = GatewayOption,
                  as_json: bool = JsonOption) -> None:
    """Every version of every adapter, with its status."""
    if gateway:
        rows = call_gateway(gateway, config, "GET", "/admin/adapters")["data"]
    else:
        rows = [v.as_dict() for v in _local(config, lambda s: s.list())]
    if as_json:
        typer.echo(orjson.dumps(rows).decode())
        return
    table = Table("name", "version", "base", "status", "published", "parent", "created", "path")
    for r in rows:
        table.add_row(r["name"], str(r["version"]), r["base_model"], r["status"], "yes" if r["published"] else "no",
                      str(r["parent_version"] or ""),
                      datetime.fromtimestamp(r["created_at"], tz=UTC).strftime("%Y-%m-%d %H:%M"), r["path"])
    console.print(table)


@app.command("register")
def register(path: Path = PathArgument,
             name: str = typer.Option(..., "--name", help="Adapter name (letters, digits, '.', '_', '-')."),
             base: str = typer.Option(..., "--base", help="The base model it was trained on, as backends serve it."),
             upload: bool = typer.Option(False, "--upload", help="Copy the folder into the adapters directory "
                                         "(through the gateway with --gateway) instead of registering its path."),
             config: str | None = ConfigOption, gateway: str | None = GatewayOption,
             as_json: bool = JsonOption) -> None:
    """Add a new version of NAME as a candidate."""
    folder = path.expanduser().resolve()
    if upload:
        try:
            data = archive.pack(folder)
        except RegistryError as exc:
            fail(exc.message, 2)
        if gateway:
            card = call_gateway(gateway, config, "POST", "/admin/adapters", params={"name": name, "base": base},
                                content=data, headers={"Content-Type": "application/gzip"})
        else:
            card = _card(_local(config, lambda s: s.register(name, base, upload=data)))
    elif gateway:
        card = call_gateway(gateway, config, "POST", "/admin/adapters",
                            json={"name": name, "base": base, "path": str(folder)})
    else:
        card = _card(_local(config, lambda s: s.register(name, base, path=str(folder))))
    _show(card, as_json, "registered")


@app.command("publish")
def publish(ref: str = typer.Argument(..., help="NAME or NAME@VERSION (default: the newest)."),
            config: str | None = ConfigOption, gateway: str | None = GatewayOption, as_json: bool = JsonOption) -> None:
    """Load a version into every backend serving its base, and keep it loaded."""
    name, version = _version_of(ref)
    if gateway:
        card = call_gateway(gateway, config, "POST", f"/admin/adapters/{name}/publish", json={"version": version})
    else:
        found, _ = _local(config, lambda s: s.publish(name, version))
        card = _card(found)
    _show(card, as_json, "published")


@app.command("promote")
def promote(ref: str = typer.Argument(..., help="NAME@VERSION"), config: str | None = ConfigOption,
            gateway: str | None = GatewayOption, as_json: bool = JsonOption) -> None:
    """Make a version the one BASE:NAME resolves to."""
    name, version = _exact(ref)
    if gateway:
        card = call_gateway(gateway, config, "POST", f"/admin/adapters/{name}/promote", json={"version": version})
    else:
        found, replaced = _local(config, lambda s: s.promote(name, version))
        card = _card(found, replaced=replaced.version if replaced else None)
    _show(card, as_json, "promoted")


@app.command("rollback")
def rollback(name: str = typer.Argument(..., help="NAME"), config: str | None = ConfigOption,
             gateway: str | None = GatewayOption, as_json: bool = JsonOption) -> None:
    """Re-activate the version that was active before the current one."""
    if gateway:
        card = call_gateway(gateway, config, "POST", f"/admin/adapters/{name}/rollback")
    else:
        restored, demoted = _local(config, lambda s: s.rollback(name))
        card = _card(restored, replaced=demoted.version)
    _show(card, as_json, "rolled back to")


@app.command("retire")
def retire(ref: str = typer.Argument(..., help="NAME@VERSION"), config: str | None = ConfigOption,
           gateway: str | None = GatewayOption, as_json: bool = JsonOption) -> None:
    """Stop serving a version for good; it is unloaded once its requests finish."""
    name, version = _exact(ref)
    if gateway:
        card = call_gateway(gateway, config, "POST", f"/admin/adapters/{name}/retire", json={"version": version})
    else:
        card = _card(_local(config, lambda s: s.retire(name, version)))
    _show(card, as_json, "retired")
