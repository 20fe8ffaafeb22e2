"""What every ``harness`` command group shares: the ``--config`` option, reading settings, failing clearly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import httpx
import typer
from rich.console import Console

from gateway.config import ConfigError, load_settings
from replay.store import TrajectoryStore
from training.settings import HarnessSettings

T = TypeVar("T")

ConfigOption = typer.Option(None, "--config", "-c", help="TOML config file (default: $HARNESS_CONFIG).")
HostOption = typer.Option(None, "--host", help="Override [server] host.")
PortOption = typer.Option(None, "--port", help="Override [server] port.")
GatewayOption = typer.Option(None, "--gateway", help="Act on a running gateway at this URL instead of the store.")
JsonOption = typer.Option(False, "--json", help="Machine-readable output.")

err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` to stderr and exit: 1 for a failed action, 2 for a usage or config problem."""
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def format_time(ts: float | None) -> str:
    """A stored unix time as UTC for tables; empty for none."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else ""


def server_flags(host: str | None = None, port: int | None = None) -> dict[str, Any]:
    """The command-line flags that override ``[server]``, shaped like the file: the highest source."""
    server = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    return {"server": server} if server else {}


def settings_or_exit(config: str | None, flags: dict[str, Any] | None = None) -> HarnessSettings:
    """The whole configuration (every section, ``[training]`` included: one file serves every command)."""
    try:
        return load_settings(config, flags=flags, model=HarnessSettings)
    except ConfigError as exc:
        fail(str(exc), 2)


def call_gateway(url: str, config: str | None, method: str, path: str, *, headers: dict[str, str] | None = None,
                 **kwargs: Any) -> Any:
    """A JSON admin route of a running gateway, with the admin key the config names (``[server] admin_key_env``,
    default ``HARNESS_ADMIN_KEY``); exits with its error."""
    server = settings_or_exit(config).server
    key = server.admin_key
    if not key:
        fail(f"set {server.admin_key_env} to the gateway's admin key", 2)
    try:
        response = httpx.request(method, url.rstrip("/") + path,
                                 headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=600.0, **kwargs)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the gateway at {url}: {exc}")
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text[:300]}}
    if response.status_code >= 400:
        fail(f"{response.status_code}: {(body.get('error') or {}).get('message', body)}")
    return body


def with_store(settings: HarnessSettings, fn: Callable[[TrajectoryStore], Awaitable[T]]) -> T:
    """Run ``fn`` on the configured store, opened for it and closed after."""

    async def run() -> T:
        store = TrajectoryStore(settings.store.location, settings.store)
        await store.start()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())
