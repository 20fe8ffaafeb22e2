"""What every ``harness`` command group shares: the ``--config`` option, reading settings, failing clearly."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

from gateway.config import ConfigError, Settings, load_settings

ConfigOption = typer.Option(None, "--config", "-c", help="TOML config file (default: $HARNESS_CONFIG).")

err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` to stderr and exit: 1 for a failed action, 2 for a usage or config problem."""
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def settings_or_exit(config: str | None) -> Settings:
    try:
        return load_settings(config)
    except ConfigError as exc:
        fail(str(exc), 2)
