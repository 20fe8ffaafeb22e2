"""``harness keys``: API keys (stored hashed, one tenant each) and each key's own limits."""

from __future__ import annotations

import json
from typing import Any

import orjson
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from gateway.auth import hash_secret, new_secret
from gateway.config import Settings
from gateway.quotas.settings import Limits, unpriced
from harness.support import ConfigOption, fail, format_time, settings_or_exit, with_store
from replay import keys

app = typer.Typer(help="API keys (stored hashed, one tenant each).", no_args_is_help=True)
console = Console()

# One option per limit, the same on create and update: (field, flag, help).
_LIMIT_FLAGS = (
    ("requests_per_minute", "--rpm", "Requests per minute."),
    ("tokens_per_minute", "--tpm", "Prompt plus completion tokens per minute."),
    ("max_concurrent", "--max-concurrent", "Requests in flight at once."),
    ("tokens_per_day", "--tokens-per-day", "Tokens per UTC day."),
    ("tokens_per_month", "--tokens-per-month", "Tokens per UTC month."),
    ("usd_per_day", "--usd-per-day", "Spend per UTC day, in US dollars (\\[prices] must price every model)."),
    ("usd_per_month", "--usd-per-month", "Spend per UTC month, in US dollars."),
)


_OPTIONS = {flag: typer.Option(None, flag, help=text) for _, flag, text in _LIMIT_FLAGS}
_CLEAR = typer.Option(None, "--clear", help="Drop this key's own limit (a flag such as --rpm, or 'all'): the "
                      "configured default applies again.")


def _own_limits(settings: Settings, *given: float | None) -> dict[str, Any]:
    """The limits given on the command line (one value per ``_LIMIT_FLAGS`` entry, in its order), checked as the
    config's are."""
    own = {name: value for (name, _, _), value in zip(_LIMIT_FLAGS, given, strict=True) if value is not None}
    try:
        Limits.model_validate(own)
    except ValidationError as exc:
        fail("; ".join(f"--{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()), 2)
    if any(name.startswith("usd_") for name in own):
        missing = unpriced(settings.backends, settings.prices)
        if missing:
            fail(f"a budget in money needs a [prices] entry for every model; none for: {', '.join(missing)}", 2)
    return own


def _limits_text(row: dict[str, Any]) -> str:
    own = json.loads(row.get("limits") or "{}")
    return ", ".join(f"{name}={value:g}" for name, value in own.items())


@app.command("create")
def keys_create(tenant: str = typer.Option(..., help="Tenant this key belongs to."),
                name: str | None = typer.Option(None, help="A label for people."),
                capture: bool = typer.Option(True, "--capture/--no-capture", help="Record this key's traffic."),
                default_model: str | None = typer.Option(None, help="Model for this key's requests that name none."),
                allow_model_override: bool = typer.Option(
                    False, "--allow-model-override", help="Let this key replace the model with the override header."),
                rpm: int | None = _OPTIONS["--rpm"],
                tpm: int | None = _OPTIONS["--tpm"],
                max_concurrent: int | None = _OPTIONS["--max-concurrent"],
                tokens_per_day: int | None = _OPTIONS["--tokens-per-day"],
                tokens_per_month: int | None = _OPTIONS["--tokens-per-month"],
                usd_per_day: float | None = _OPTIONS["--usd-per-day"],
                usd_per_month: float | None = _OPTIONS["--usd-per-month"],
                config: str | None = ConfigOption) -> None:
    """Create a key; the secret is printed once and stored only as a hash. Limits not given are \\[limits.key]'s."""
    settings = settings_or_exit(config)
    own = _own_limits(settings, rpm, tpm, max_concurrent, tokens_per_day, tokens_per_month, usd_per_day, usd_per_month)
    secret = new_secret()
    key_id = with_store(settings, lambda s: keys.create(s,
        tenant=tenant, name=name, capture=capture, secret_hash=hash_secret(secret), default_model=default_model,
        allow_model_override=allow_model_override, limits=own))
    typer.echo(f"id:     {key_id}\ntenant: {tenant}\nkey:    {secret}\n(the key is shown only now)")


@app.command("update")
def keys_update(key_id: str,
                rpm: int | None = _OPTIONS["--rpm"],
                tpm: int | None = _OPTIONS["--tpm"],
                max_concurrent: int | None = _OPTIONS["--max-concurrent"],
                tokens_per_day: int | None = _OPTIONS["--tokens-per-day"],
                tokens_per_month: int | None = _OPTIONS["--tokens-per-month"],
                usd_per_day: float | None = _OPTIONS["--usd-per-day"],
                usd_per_month: float | None = _OPTIONS["--usd-per-month"],
                clear: list[str] | None = _CLEAR,
                config: str | None = ConfigOption) -> None:
    """Change a key's own limits. A running gateway sees the change within \\[server] auth_cache_seconds."""
    settings = settings_or_exit(config)
    own = _own_limits(settings, rpm, tpm, max_concurrent, tokens_per_day, tokens_per_month, usd_per_day, usd_per_month)
    by_flag = {flag: field for field, flag, _ in _LIMIT_FLAGS}
    clear = clear or []
    unknown = [c for c in clear if c != "all" and by_flag.get(c if c.startswith("--") else f"--{c}") is None]
    if unknown:
        fail(f"--clear takes a limit's flag ({', '.join(by_flag)}) or 'all', not: {', '.join(unknown)}", 2)
    if not own and not clear:
        fail("nothing to change: give a limit (e.g. --rpm 60) or --clear", 2)
    dropped = tuple(by_flag) if "all" in clear else tuple(c if c.startswith("--") else f"--{c}" for c in clear)
    row = with_store(settings, lambda s: keys.update(s, key_id, limits=own,
                                                     clear_limits=tuple(by_flag[c] for c in dropped)))
    if row is None:
        fail(f"no active key with id {key_id}")
    typer.echo(f"updated {key_id}: {_limits_text(row) or 'the configured limits'}")


@app.command("list")
def keys_list(config: str | None = ConfigOption,
              as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List keys (never their secrets)."""
    rows = with_store(settings_or_exit(config), keys.list_keys)
    if as_json:
        typer.echo(orjson.dumps([{**r, "limits": json.loads(r["limits"] or "{}")} for r in rows]).decode())
        return
    table = Table("id", "tenant", "name", "capture", "default model", "override", "own limits", "created", "revoked")
    for r in rows:
        table.add_row(r["id"], r["tenant"], r["name"] or "", "yes" if r["capture"] else "no",
                      r["default_model"] or "", "yes" if r["allow_model_override"] else "no", _limits_text(r),
                      format_time(r["created_at"]), format_time(r["revoked_at"]) if r["revoked_at"] else "")
    console.print(table)


@app.command("revoke")
def keys_revoke(key_id: str, config: str | None = ConfigOption) -> None:
    """Revoke a key by id."""
    if not with_store(settings_or_exit(config), lambda s: keys.revoke(s, key_id)):
        fail(f"no active key with id {key_id}")
    typer.echo(f"revoked {key_id}")
