"""``harness replay rewards``: recompute and store the rewards of the selected trajectories.

``rewards`` takes the selection as one ``filters: Filters`` argument; ``harness/replay.py`` adds the filter
flags and registers it::

    from harness.rewards import rewards
    app.command("rewards")(with_filters(rewards))

It imports nothing from ``harness.replay``, so neither module's import waits on the other. Exit codes follow
``harness.replay``: 2 for bad usage or configuration, 1 for a run that could not do its work (no store, not a
store, a newer schema, a corrupt file, a failing signal).
"""

from __future__ import annotations

import asyncio
import importlib
import sqlite3

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from gateway.logging import configure_logging
from harness.support import ConfigOption, err_console, fail, settings_or_exit
from replay.filters import Filters
from replay.readonly import StoreError, check_file
from replay.rewards import RewardError, RewardSummary, recompute, signal_weights, step_limits
from replay.store import TrajectoryStore

StoreOption = typer.Option(None, "--store", help="The SQLite store (default: \\[store] path from the config).")
SignalsOption = typer.Option(None, "--signals", help="A module to import first, which registers signals "
                             "that \\[rewards] weights (repeatable).")
JsonOption = typer.Option(False, "--json", help="Machine-readable summary.")

def rewards(filters: Filters, config: str | None = ConfigOption, store: str | None = StoreOption,
            signals: list[str] | None = SignalsOption, as_json: bool = JsonOption) -> None:
    """Recompute the rewards of the selected trajectories and store them: each signal as a feedback row
    (source reward_engine, per step where a signal credits steps) and the weighted total as final_reward."""
    settings = settings_or_exit(config)
    configure_logging("console", "warning")  # stdout is for results (--json), not log lines
    path = store if store is not None else settings.store.location
    for module in signals or []:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever stops the import, the user must see it
            fail(f"cannot import signal module {module!r}: {exc}", 2)
    try:
        signal_weights(settings.rewards)
    except RewardError as exc:
        fail(str(exc), 2)
    try:
        check_file(path)  # never create a store where there is none
    except StoreError as exc:
        fail(str(exc))
    limits = step_limits(settings.profiles)

    async def main() -> RewardSummary:
        trajectories = TrajectoryStore(path, settings.store)
        await trajectories.start()  # migrates an older store; refuses a newer one
        try:
            with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          console=err_console, transient=True, disable=not err_console.is_terminal) as progress:
                task = progress.add_task("rewards", total=None)
                return await recompute(trajectories, filters, settings.rewards, step_limits=limits,
                                       progress=lambda done, n: progress.update(task, completed=done, total=n))
        finally:
            await trajectories.close()

    try:
        summary = asyncio.run(main())
    except RewardError as exc:
        fail(str(exc))
    except (sqlite3.DatabaseError, RuntimeError, OSError) as exc:
        # A corrupt file, a newer schema (migrate refuses it), an unwritable directory.
        fail(f"cannot score the trajectories in {path}: {exc}")
    if as_json:
        typer.echo(orjson.dumps(summary.to_dict()).decode())
    if summary.count == 0 and summary.skipped == 0:
        err_console.print("no trajectories match the filters")
        return
    if not as_json:
        print_summary(Console(), summary)


def print_summary(console: Console, summary: RewardSummary) -> None:
    mean = "-" if summary.mean_reward is None else f"{summary.mean_reward:.4f}"
    skipped = f", {summary.skipped} still running (skipped)" if summary.skipped else ""
    console.print(f"scored {summary.count:,} trajectories{skipped}; mean reward {mean}; "
                  f"task success unknown for {summary.unknown_success:,}", highlight=False)
    table = Table("signal", "weight", "mean", "unknown", title="Signals")
    for name, weight in summary.weights.items():
        value = summary.signal_means.get(name)
        table.add_row(name, f"{weight:g}", "-" if value is None else f"{value:.4f}",
                      f"{summary.signal_unknown.get(name, 0):,}")
    console.print(table)
