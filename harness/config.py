"""``harness config``: the effective configuration and where each value came from, a file's mistakes, the reference.

- ``show``: every key as TOML, each followed by its source (flag, environment, file or default); the variables the
  ``*_env`` keys name are reported set or not, their values never printed.
- ``check FILE``: one line per unknown or wrong key, by its dotted path; exit 1 when there is any.
- ``docs``: regenerates the key tables of ``docs/configuration.md`` from the models (``harness/config_docs.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel

from gateway.config import ConfigError, load_settings, load_with_sources, source_of
from harness.config_docs import DOCS_PATH, render_docs
from harness.support import ConfigOption, HostOption, PortOption, err_console, fail, server_flags
from replay.database import redact_url
from training.settings import HarnessSettings

app = typer.Typer(help="The configuration: effective values and their sources, checks, the reference.",
                  no_args_is_help=True)

FileArgument = typer.Argument(..., help="The TOML file to check.")
CheckOption = typer.Option(False, "--check", help="Exit 1 if the file is stale; write nothing.")
DocsPathOption = typer.Option(DOCS_PATH, "--path", help="The reference to regenerate.")

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(name: str) -> str:
    return name if BARE_KEY.match(name) else json.dumps(name, ensure_ascii=False)


def toml_value(value: Any) -> str:
    """A JSON-mode value as TOML: JSON's strings, numbers and arrays are TOML's too; tables go inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _owner(settings: BaseModel, path: tuple[str | int, ...]) -> Any:
    node: Any = settings
    for part in path:
        node = node[part] if isinstance(part, int) else getattr(node, part, None)
    return node


def render_effective(settings: HarnessSettings, layers: dict[str, Any]) -> str:
    """The settings as TOML, each key followed by ``# <source>``."""
    lines: list[str] = []

    def table(path: tuple[str | int, ...], header: str, node: dict[str, Any], array: bool) -> None:
        if header:
            lines.extend(["", f"[[{header}]]" if array else f"[{header}]"])
        owner = _owner(settings, path)
        nested = []
        for key, value in node.items():
            if (isinstance(value, dict) and value and isinstance(getattr(owner, key, None), BaseModel)) \
                    or _is_table_array(value):
                nested.append((key, value))
                continue
            source = source_of(layers, (*path, key))
            if key.endswith("_env") and isinstance(owner, BaseModel) and key[:-4] in type(owner).model_fields:
                # The secret itself is never printed: only whether its variable holds one.
                held = getattr(owner, key[:-4]) is not None
                source += f"; the secret: {'set, hidden' if held else 'not set'}"
            if value is None:
                lines.append(f"# {_key(key)} is unset  # {source}")
            else:
                # A URL's password (the store's, Redis's) is a secret too.
                shown = redact_url(value) if isinstance(value, str) else value
                lines.append(f"{_key(key)} = {toml_value(shown)}  # {source}")
        for key, value in nested:
            name = f"{header}.{_key(key)}" if header else _key(key)
            if isinstance(value, list):
                for i, entry in enumerate(value):
                    table((*path, key, i), name, entry, True)
            else:
                table((*path, key), name, value, False)

    table((), "", settings.model_dump(mode="json"), False)
    return "\n".join(lines).lstrip("\n") + "\n"


@app.command("show")
def show(config: str | None = ConfigOption, host: str | None = HostOption, port: int | None = PortOption) -> None:
    """The effective configuration as TOML, each value followed by its source (flag, environment, file, default);
    secrets hidden. Takes the flags ``harness serve`` takes, so it shows what serve would run with."""
    try:
        settings, layers = load_with_sources(config, flags=server_flags(host, port), model=HarnessSettings)
    except ConfigError as exc:
        for problem in exc.problems:
            err_console.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    typer.echo("# The effective configuration; after each key, its source: flag, environment, file or default.")
    typer.echo(f"# File: {layers['path'] or 'none'}\n")
    typer.echo(render_effective(settings, layers), nl=False)


@app.command("check")
def check(file: Path = FileArgument) -> None:
    """Validate a config file alone (the environment is not read): one line per unknown or wrong key, by its
    dotted path, and exit 1 when there is any."""
    try:
        load_settings(file, environ={}, model=HarnessSettings)
    except ConfigError as exc:
        for problem in exc.problems:
            line = problem if problem.startswith(str(file)) else f"{file}: {problem}"
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    typer.echo(f"{file}: ok")


@app.command("docs")
def docs(check_only: bool = CheckOption, path: Path = DocsPathOption) -> None:
    """Regenerate the key tables of docs/configuration.md from the settings models."""
    try:
        current = path.read_text()
        wanted = render_docs(current)
    except (OSError, ValueError) as exc:
        fail(str(exc))
    if check_only:
        if wanted != current:
            fail(f"{path} is stale: run 'harness config docs'")
        typer.echo(f"{path}: current")
        return
    path.write_text(wanted)
    typer.echo(f"wrote {path}")
