"""``harness eval``, ``harness tasks`` and ``harness replay-train``.

Heavy modules (torch, transformers, the suites) are imported inside the commands, so ``harness --help`` and
every other command start fast.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import typer
from rich.console import Console

from extras import require_extra
from gateway.logging import configure_logging
from harness.replay import with_filters
from harness.support import ConfigOption, fail, settings_or_exit
from replay.adapters import AdapterRegistry, RegistryError, parse_ref
from replay.database import redact_url
from replay.filters import Filters
from training.settings import HarnessSettings

if TYPE_CHECKING:
    from training.evaluate import Report

SPLITS = ("train", "validation", "test")

console = Console()
tasks_app = typer.Typer(help="Task suites: list them, capture demonstrations and attempts into the store.",
                        no_args_is_help=True)

SuiteOption = typer.Option(None, "--suite", help="Task suite (default: [training] suite).")
OutOption = typer.Option(None, "--out", help="Folder for eval.json and eval.png (default: under [training] "
                         "output_dir).")


def _suite(settings: HarnessSettings, suite: str | None) -> str:
    from training.tasks import SUITES

    name = suite or settings.training.suite
    if name not in SUITES:
        fail(f"no suite {name!r}; known: {', '.join(sorted(SUITES))}", 2)
    return name


def _split(split: str) -> str:
    if split not in SPLITS:
        fail(f"--split must be one of {', '.join(SPLITS)}, not {split!r}", 2)
    return split


def adapter_folder(settings: HarnessSettings, model: str) -> str | None:
    """``base``, an adapter folder, or a registered ``name[@version]`` (default: its active version)."""
    if model == "base":
        return None
    if Path(model).is_dir():
        if not (Path(model) / "adapter_config.json").is_file():
            fail(f"{model} is not an adapter folder: it has no adapter_config.json", 2)
        return str(Path(model).resolve())
    registry = AdapterRegistry(settings.store.location)
    try:
        name, version = parse_ref(model)
        if version is None:
            active = registry.active(name)
            if active is None:
                fail(f"adapter {name!r} has no active version; name one as {name}@N", 2)
            return active.path
        return registry.get(name, version).path
    except RegistryError as exc:
        fail(f"{model!r} is neither 'base', an adapter folder, nor a registered adapter: {exc.message}", 2)


ModelArgument = typer.Argument(..., help="'base', an adapter folder, or a registered NAME[@V].")


def eval_command(model: str = ModelArgument,
                 suite: str | None = SuiteOption,
                 split: str = typer.Option("validation", "--split", help="validation or test."),
                 out: Path | None = OutOption, config: str | None = ConfigOption,
                 as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")) -> None:
    """Run a suite's split through the agent loop on the embedded model (with an adapter, or the base)."""
    settings = settings_or_exit(config)
    configure_logging("console", "warning")
    suite_name, split = _suite(settings, suite), _split(split)
    adapter = adapter_folder(settings, model)
    require_extra("train", "harness eval")
    from training.evaluate import Evaluator, report_table, write_reports
    from training.general import GeneralCheck

    async def run() -> Report:
        check = GeneralCheck(settings.training)
        async with Evaluator(settings.training) as evaluator:
            return await evaluator.evaluate(suite_name, split, adapter, general=check.losses, label=model)

    report = asyncio.run(run())
    folder = out or Path(settings.training.output_dir) / "eval" / f"{suite_name}-{split}-{Path(model).name}"
    json_path, png_path = write_reports([report], folder, title=f"{suite_name} / {split}")
    if as_json:
        typer.echo(orjson.dumps(report.metrics).decode())
    else:
        console.print(report_table([report], f"{suite_name} / {split}"))
        console.print(f"wrote {json_path} and {png_path}")


@tasks_app.command("list")
def tasks_list(suite: str | None = SuiteOption, split: str = typer.Option("train", "--split"),
               config: str | None = ConfigOption) -> None:
    """The tasks of a split, one line each."""
    from training.tasks import get_suite

    settings = settings_or_exit(config)
    for task in get_suite(_suite(settings, suite), data_dir=settings.training.tasks_dir).tasks(_split(split)):
        typer.echo(f"{task.id}\t{task.family}\t{task.prompt}")


@tasks_app.command("capture")
def tasks_capture(suite: str | None = SuiteOption, split: str = typer.Option("train", "--split"),
                  demos: bool = typer.Option(True, "--demos/--no-demos", help="Store the solver's demonstrations."),
                  attempts: int = typer.Option(1, "--attempts", min=0, help="Model attempts per task."),
                  sample: int | None = typer.Option(None, "--sample", min=1, help="Attempt only this many tasks, "
                                                    "evenly spread over the split (demonstrations cover all)."),
                  temperature: float | None = typer.Option(None, "--temperature", min=0.0, max=2.0,
                                                           help="Sampling temperature of the attempts "
                                                           "(default: capture's own)."),
                  config: str | None = ConfigOption) -> None:
    """Capture a split into the store: demonstrations (source demo) and the model's attempts (source agent),
    each with the verifier's verdict. The test split is refused: nothing from it may reach training."""
    require_extra("train", "harness tasks capture")
    from training.capture import capture

    settings = settings_or_exit(config)
    configure_logging("console", "warning")
    if _split(split) == "test":
        fail("the test split is for reporting and the gate only; capture train or validation", 2)
    started = time.perf_counter()
    chosen = {} if temperature is None else {"temperature": temperature}
    result = asyncio.run(capture(settings, _suite(settings, suite), split, demos=demos, attempts=attempts,
                                 sample=sample, **chosen))
    console.print(f"captured {result.demonstrations} demonstrations and {result.attempts} attempts "
                  f"({result.attempts_succeeded} succeeded) into {redact_url(settings.store.location)} "
                  f"in {time.perf_counter() - started:.0f} s")


@with_filters
def replay_train_command(filters: Filters,
                         mode: str = typer.Option("sft", "--mode", help="sft, rl (group-relative RL on rollouts "
                                                  "and captured groups) or sft+rl (RL from the SFT candidate)."),
                         init: str | None = typer.Option(None, "--init", help="--mode rl: the adapter RL starts "
                                                         "from (a folder, NAME@VERSION, or base for a fresh "
                                                         "adapter); default the adapter's active version."),
                         name: str | None = typer.Option(None, "--name", help="Adapter name (default: the suite's)."),
                         publish: str | None = typer.Option(None, "--publish", help="A running gateway's URL: upload, "
                                                            "publish and promote the adapter there if it passes."),
                         gateway: str | None = typer.Option(None, "--gateway", help="A running gateway's URL: "
                                                            "run every episode (rollouts, validation, the gate) "
                                                            "through its backends, each adapter published there "
                                                            "as a version first (admin key from "
                                                            "HARNESS_ADMIN_KEY)."),
                         teacher: str | None = typer.Option(None, "--teacher", help="A model the gateway at "
                                                            "[training.correction] teacher_url (default --publish's "
                                                            "URL) serves, to label on-policy correction rounds "
                                                            "instead of the suite's solver (key from "
                                                            "HARNESS_TEACHER_KEY); turns one round on if none is set."),
                         config: str | None = ConfigOption) -> None:
    """Select, reward, train (SFT, group-relative RL, or both), pick a checkpoint on validation, gate on test,
    register, publish. Exits 0 when the candidate passed the gate, 1 when it was refused (it is still registered,
    as a candidate).

    Production traffic has no verifier: a user's rating is its task success (POST /v1/trajectories/ID/feedback).
    With the default reward weights, --min-reward 0.7 keeps the runs rated up, never unrated or rated-down ones.
    For example: harness replay-train --source proxy --min-reward 0.7 (docs/training.md)."""
    require_extra("train", "harness replay-train")
    from training import distributed
    from training.on_gateway import GatewayRefused
    from training.replay_train import MODES, ReplayTrainError, replay_train

    settings = settings_or_exit(config)
    configure_logging("console", "warning")
    if mode not in MODES:
        fail(f"--mode {mode!r} is not one of {', '.join(MODES)}", 2)
    if init is not None and mode != "rl":
        fail("--init applies to --mode rl only (sft+rl starts from its own SFT candidate)", 2)
    start = init if init in (None, "base") else adapter_folder(settings, init)
    if teacher is not None:
        correction = settings.training.correction
        url = correction.teacher_url if "teacher_url" in correction.model_fields_set or not publish else publish
        settings.training.correction = correction.model_copy(update={
            "teacher": teacher, "teacher_url": url, "rounds": correction.rounds or 1})
    # Under torchrun: rank 0 runs the pipeline, the others train alongside it (training/distributed.py).
    world = distributed.join(settings.training.rank_timeout_seconds)
    try:
        if world is not None and not world.leads:
            distributed.follow(world)
            distributed.finish(world)
            raise typer.Exit(0)
        outcome = asyncio.run(replay_train(settings, filters, mode=mode, init=start, name=name, publish=publish,
                                           gateway=gateway, console=console))
        distributed.finish(world)
    except (ReplayTrainError, GatewayRefused, distributed.RankFailure) as exc:
        # Nothing more is said to the other ranks: a rank that stops ends their next collective.
        fail(str(exc))
    raise typer.Exit(0 if outcome.decision and outcome.decision.passed else 1)


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.command("replay-train")(replay_train_command)
    app.add_typer(tasks_app, name="tasks")

