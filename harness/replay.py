"""``harness replay``: select, inspect, import and export trajectories.

Read commands (stats, export) open the store read-only (``replay.readonly``): they never migrate or write
it. Import goes through the store's normal write path. Every failure ends with a one-line ``error: …`` on
stderr and a non-zero exit: 1 for a run that could not do its work, 2 for bad usage or configuration.
"""

from __future__ import annotations

import functools
import inspect
import sqlite3
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from harness.rewards import rewards
from harness.support import ConfigOption, err_console, fail, settings_or_exit, with_store
from replay import export as exporting
from replay import stats as stats_module
from replay.database import is_postgres
from replay.filters import Filters, parse_time
from replay.importer import ImportFileError, import_conversations, read_file
from replay.readonly import StoreError, open_readonly, schema_version
from replay.redact import Redactor
from replay.schema import SCHEMA_VERSION
from replay.writer import RecordRejected

app = typer.Typer(help="Select, inspect, import and export trajectories.", no_args_is_help=True)
console = Console()

StoreOption = typer.Option(None, "--store",
                           help="The store: an SQLite file or a postgresql:// URL (default: the config's).")
RedactPatternOption = typer.Option([], "--redact-pattern", help="Another regular expression to redact (repeatable).")

# -- filters: declared once, added to every command that selects trajectories ----------------------------

_FILTER_HELP = {
    "since": "Created at or after (ISO 8601 date or time, UTC unless it says otherwise; or unix seconds).",
    "until": "Created before (same forms as --since).",
    "source": "proxy | agent | bot | rollout | eval | demo.",
    "model": "Requested model (or its base model).",
    "adapter": "Adapter name.",
    "status": "completed | terminated | error | client_disconnected | interrupted | ...",
    "reason": "Termination reason.",
    "min_reward": "Final reward at least this.",
    "max_reward": "Final reward at most this.",
    "task": "Task id.",
    "group": "Group id (the samples of one request, or attempts at one task).",
    "parent": "Forks of this trajectory (its id).",
    "tenant": "Tenant.",
}
def _filter_type(name: str) -> Any:
    # A number stays a number on the command line; anything else (times included) is parsed by Filters.
    hint = typing.get_type_hints(Filters)[name]
    return hint if hint in (float | None, int | None) else str | None


def _filter_params() -> list[inspect.Parameter]:
    """One flag per Filters field, so a field added there appears on every command at once."""
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=_filter_type(name),
                              default=typer.Option(None, f"--{name.replace('_', '-')}",
                                                   help=_FILTER_HELP.get(name, name.replace("_", " ")),
                                                   rich_help_panel="Filters"))
            for name in Filters.names()]


def with_filters(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the filter flags to a command, which receives them as one ``filters: Filters`` argument."""
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.name != "filters"] + _filter_params()

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in Filters.names()}
        for name in ("since", "until"):
            if values[name] is not None:
                try:
                    parse_time(values[name])
                except ValueError:
                    raise typer.BadParameter(f"{values[name]!r} is not an ISO 8601 time or unix seconds",
                                             param_hint=f"--{name}") from None
        return fn(filters=Filters(**values), **kwargs)

    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # typer must see the new signature, not the wrapped one
    return wrapper


# -- shared plumbing ------------------------------------------------------------------------------------------


def _store_path(config: str | None, store: str | None) -> tuple[Any, str]:
    from gateway.logging import configure_logging

    settings = settings_or_exit(config)
    configure_logging("console", "warning")  # stdout is for results (--json), not log lines
    if store is not None:  # a file, or a URL (the read commands refuse it with a way forward)
        settings.store.url, settings.store.path = ((store, settings.store.path) if is_postgres(store)
                                                   else (None, store))
    return settings, settings.store.location


@contextmanager
def _reading(path: str) -> Iterator[sqlite3.Connection]:
    """The store opened read-only; every way that can fail becomes a clear message."""
    try:
        with open_readonly(path) as conn:
            yield conn
    except StoreError as exc:
        fail(str(exc))
    except sqlite3.DatabaseError as exc:
        # The base class is what SQLite raises for a damaged file ("database disk image is malformed").
        damaged = " (the file may be damaged)" if type(exc) is sqlite3.DatabaseError else ""
        fail(f"{path} cannot be read: {exc}{damaged}")


def _progress(label: str) -> Progress:
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True, disable=not err_console.is_terminal)


# -- stats ----------------------------------------------------------------------------------------------------


@app.command()
@with_filters
def stats(filters: Filters, config: str | None = ConfigOption, store: str | None = StoreOption,
          as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Counts, success rate, tool-call validity, termination reasons, steps and tokens, per model/adapter."""
    _, path = _store_path(config, store)
    with _reading(path) as conn:
        summary = stats_module.compute(conn, filters)
    if as_json:
        typer.echo(orjson.dumps(summary).decode())
    if not summary["trajectories"]:
        err_console.print("no trajectories match the filters")
        return
    if not as_json:
        _print_stats(summary)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"


def _print_stats(s: dict[str, Any]) -> None:
    tc = s["tool_calls"]
    overview = Table("", "", title="Selection", show_header=False)
    for label, value in (
            ("trajectories", _num(s["trajectories"])), ("success rate (completed / all)", _pct(s["success_rate"])),
            ("model calls", _num(s["model_calls"]["total"])), ("tool calls", _num(tc["total"])),
            ("valid tool calls", _pct(tc["valid_rate"])), ("invalid tool calls", _pct(tc["invalid_rate"])),
            ("steps (model calls) mean / p95", f"{_num(s['steps']['mean'])} / {_num(s['steps']['p95'])}"),
            ("tokens mean / p95", f"{_num(s['tokens']['mean'])} / {_num(s['tokens']['p95'])}"),
            ("rewarded / mean reward", f"{_num(s['rewards']['count'])} / {_num(s['rewards']['mean'])}")):
        overview.add_row(label, value)
    console.print(overview)
    for title, counts in (("Status", s["by_status"]), ("Termination reasons", s["termination_reasons"]),
                          ("Sources", s["sources"]), ("Model calls by status", s["model_calls"]["by_status"])):
        if counts:
            table = Table("", "count", "share", title=title)
            whole = sum(counts.values())
            for key, n in counts.items():
                table.add_row(str(key), _num(n), _pct(n / whole))
            console.print(table)
    models = Table("model", "adapter", "trajectories", "success", "tool calls", "invalid",
                   "steps mean/p95", "tokens mean/p95", "reward", title="By model / adapter")
    for m in s["by_model"]:
        models.add_row(m["model"] or "-", m["adapter"] or "-", _num(m["trajectories"]), _pct(m["success_rate"]),
                       _num(m["tool_calls"]), _pct(m["invalid_tool_call_rate"]),
                       f"{_num(m['steps_mean'])} / {_num(m['steps_p95'])}",
                       f"{_num(m['tokens_mean'])} / {_num(m['tokens_p95'])}", _num(m["mean_reward"]))
    console.print(models)


# -- export ---------------------------------------------------------------------------------------------------


@app.command()
@with_filters
def export(filters: Filters,
           fmt: str = typer.Option(..., "--format", "-f",
                                   help="chat-jsonl (a file), hf (a datasets directory), or trl or verl (a directory "
                                        "of what their SFT and GRPO trainers read: docs/replay.md)."),
           output: str = typer.Option(..., "--output", "-o", help="Where to write; replaced only once complete."),
           window: int = typer.Option(1, "--window", min=0,
                                      help="Calls per row: each row is the last call's context of up to N "
                                           "consecutive calls that extend each other (0: no limit)."),
           include_failed: bool = typer.Option(False, "--include-failed",
                                               help="Also export calls that failed or were cut off."),
           by_group: bool = typer.Option(False, "--by-group", help="Rows of one group together."),
           redact: bool = typer.Option(True, "--redact/--no-redact", help="Remove secrets and e-mail addresses "
                                       "(on by default; see store.redact_defaults)."),
           redact_pattern: list[str] = RedactPatternOption,
           force: bool = typer.Option(False, "--force", help="Replace OUTPUT if it exists."),
           jobs: int = typer.Option(0, "--jobs", "-j", min=0,
                                    help="chat-jsonl: worker processes (0: one per CPU for 20,000+ trajectories)."),
           config: str | None = ConfigOption, store: str | None = StoreOption) -> None:
    """Training rows from the contexts as actually sent, with tools, metadata and exact token ids."""
    if fmt not in exporting.FORMATS:
        fail(f"--format must be one of {', '.join(exporting.FORMATS)}, not {fmt!r}", 2)
    settings, path = _store_path(config, store)
    if not redact and redact_pattern:
        fail("--no-redact and --redact-pattern contradict each other", 2)
    try:
        redactor = Redactor(defaults=redact and settings.store.redact_defaults,
                            patterns=[*settings.store.redact_patterns, *redact_pattern] if redact else [])
    except ValueError as exc:
        fail(str(exc), 2)
    options = exporting.ExportOptions(window=window, include_failed=include_failed, by_group=by_group, jobs=jobs)
    with _reading(path) as conn:
        total = exporting.count(conn, filters)
        with _progress("exporting") as progress:
            task = progress.add_task("export", total=total)
            try:
                result = exporting.export(conn, filters, output, fmt=fmt, options=options, redactor=redactor,
                                          overwrite=force, on_chunk=lambda n: progress.advance(task, n))
            except exporting.ExportError as exc:
                fail(str(exc))
    rate = result.trajectories / result.seconds if result.seconds else 0
    err_console.print(f"exported {result.rows:,} rows from {result.trajectories:,} trajectories "
                      f"({result.redacted_rows:,} rows redacted) to {result.output} in {result.seconds:.1f} s "
                      f"({rate:,.0f} trajectories/s)", highlight=False, soft_wrap=True)


# -- import ---------------------------------------------------------------------------------------------------


@app.command("import")
def import_(file_name: str = typer.Argument(..., metavar="FILE",
                                           help='Chat JSONL: one {"messages": [...], "tools"?: [...]} a line.'),
            source: str = typer.Option("demo", "--source", help="The source the trajectories are recorded as."),
            task: str | None = typer.Option(None, "--task", help="Task id for lines that do not name one."),
            group: str | None = typer.Option(None, "--group", help="Group id for lines that do not name one."),
            tenant: str | None = typer.Option(None, "--tenant", help="Tenant the trajectories belong to."),
            model: str | None = typer.Option(None, "--model", help="Model name for lines that do not name one."),
            config: str | None = ConfigOption, store: str | None = StoreOption) -> None:
    """Import conversations as trajectories (one model call per assistant turn), all or nothing."""
    settings, _ = _store_path(config, store)
    file = Path(file_name)
    size = file.stat().st_size if file.is_file() else None
    try:
        with _progress("reading") as progress:
            task_id = progress.add_task("read", total=size)
            conversations = read_file(file, on_line=lambda n: progress.advance(task_id, n))
    except ImportFileError as exc:
        fail(f"{file}: {exc}; nothing imported")

    target = settings.store.location
    # A new store is created; an existing file must be one this program can write.
    if not is_postgres(target) and Path(target).exists():
        try:
            version = schema_version(target)
        except StoreError as exc:
            fail(f"{exc}; nothing imported")
        if version > SCHEMA_VERSION:
            fail(f"{target} has schema version {version}, newer than this program knows ({SCHEMA_VERSION}); "
                  "nothing imported")
    try:
        result = with_store(settings, lambda s: import_conversations(
            s, conversations, source=source, task=task, group=group, tenant=tenant, model=model))
    # a damaged file, an unwritable directory, a full disk, or a conversation the store cannot take
    except (sqlite3.DatabaseError, OSError, RecordRejected) as exc:
        fail(f"cannot import into {target}: {exc}; nothing imported")
    err_console.print(f"imported {result.trajectories:,} trajectories ({result.model_calls:,} model calls) "
                      f"from {file} as source {source!r}", highlight=False, soft_wrap=True)


# -- rewards --------------------------------------------------------------------------------------------------

app.command("rewards", help="Recompute and store rewards: per-signal feedback rows and each final reward.")(
    with_filters(rewards))
