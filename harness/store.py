"""``harness store``: the trajectory store as a whole; ``migrate`` copies it between SQLite and PostgreSQL.

The copying and the check are ``replay.copying``'s; this prints their progress (to stderr, on a terminal only), the
per-table comparison (to stdout), and fails with one ``error: …`` line: 1 when the copy could not be made or
differs, 2 for bad usage.
"""

from __future__ import annotations

import time

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from harness.support import err_console, fail
from replay.copying import CHUNK_ROWS, CopyError, Migration, migrate_store, same_location
from replay.database import redact_url

app = typer.Typer(help="The trajectory store as a whole: copy it between SQLite and PostgreSQL.",
                  no_args_is_help=True)
console = Console()


@app.command()
def migrate(source: str = typer.Argument(..., metavar="SRC", help="An SQLite file or a postgresql:// URL; only read."),
            destination: str = typer.Argument(..., metavar="DST",
                                              help="An SQLite file (created when missing) or a postgresql:// URL; "
                                                   "upgraded to the newest schema, then filled."),
            chunk_rows: int = typer.Option(CHUNK_ROWS, "--chunk-rows", min=1,
                                           help="Rows per committed chunk: what a rerun resumes after."),
            verify_only: bool = typer.Option(False, "--verify-only",
                                             help="Only compare SRC and DST row by row; change nothing.")) -> None:
    """Copy a whole store into another (SQLite or PostgreSQL, either way), then check every row arrived unchanged.

    A run that stopped part-way resumes where it stopped when run again."""
    from gateway.logging import configure_logging

    configure_logging("console", "warning")
    if same_location(source, destination):
        fail(f"SRC and DST are the same store ({redact_url(source)})", 2)
    started = time.monotonic()
    with _progress() as progress:
        tasks: dict[tuple[str, str], TaskID | None] = {}

        def show(phase: str, table: str, done: int, total: int) -> None:
            if (phase, table) not in tasks:
                tasks[phase, table] = progress.add_task(f"{phase} {table}", total=total)
            task = tasks[phase, table]
            if task is None:
                return
            progress.update(task, completed=done)
            if done >= total:  # a finished table's bar goes: thirty-two would push the running one off screen
                progress.remove_task(task)
                tasks[phase, table] = None

        try:
            result = migrate_store(source, destination, chunk_rows=chunk_rows, verify_only=verify_only,
                                   on_progress=show)
        except CopyError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted; every chunk committed so far is kept: run the same command again to resume", 130)
    _print(result)
    if not verify_only:
        rows = sum(c.read for c in result.copies)
        seconds = sum(c.seconds for c in result.copies)
        err_console.print(f"copied {rows:,} rows ({sum(c.inserted for c in result.copies):,} new) in {seconds:.1f} s "
                          f"({rows / seconds if seconds else 0:,.0f} rows/s); checked in "
                          f"{time.monotonic() - started - seconds:.1f} s", highlight=False, soft_wrap=True)
    differing = [c for c in result.checks if not c.ok]
    if differing:
        where = "; ".join(f"{c.table} ({c.describe()})" for c in differing)
        fail(f"DST differs from SRC in {len(differing)} table(s): {where}")


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True, disable=not err_console.is_terminal)


def _print(result: Migration) -> None:
    """One line a table; the hash once where both sides agree, both where they differ."""
    copied = {c.table: c for c in result.copies}
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("table", no_wrap=True)
    for heading in ("SRC rows", "DST rows", "copied"):
        table.add_column(heading, justify="right", no_wrap=True)
    table.add_column("sha256")
    table.add_column("", no_wrap=True)
    for check in result.checks:
        new = copied.get(check.table)
        digest = (check.source_hash[:12] if check.ok
                  else f"SRC {check.source_hash[:12]} DST {check.destination_hash[:12]}")
        table.add_row(check.table, f"{check.source_rows:,}", f"{check.destination_rows:,}",
                      f"{new.inserted:,}" if new else "-", digest, "same" if check.ok else "DIFFERS")
    console.print(table)
