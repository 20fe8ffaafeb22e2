"""Evaluation: a task suite's split run through the gateway's own agent loop, and what it says of the agent.

Every episode is one ``AgentLoop`` run (``training/episodes.py``) on the embedded backend (with the candidate's
LoRA adapter, or none), the suite's tools for the task (with its injected fault, if any), greedy decoding (or, for
several samples a task, sampling at a temperature), and the suite's verifier. Episodes run ``concurrency`` at a
time, so the backend batches their model calls.

Metrics: ``training/metrics.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import orjson
import structlog
from rich.table import Table
from tqdm import tqdm

from gateway.agent.context import TokenCounter
from gateway.backends.base import Backend, ChatRequest, ChatResult
from gateway.backends.local import LocalBackend
from gateway.backends.local.heap import release_free_memory
from gateway.config import BackendSettings
from training import distributed
from training.episodes import RecorderFor, run_episode
from training.metrics import METRICS, Episode, Loss, format_value, metrics_of, perplexity_of, success_interval
from training.settings import TrainingSettings
from training.tasks import Suite, Task, get_suite, test_only_markers

log = structlog.get_logger()

@dataclass
class Report:
    model: str  # "base", or the adapter evaluated
    suite: str
    split: str
    metrics: dict[str, float | None]
    episodes: list[Episode] = field(default_factory=list)
    seconds: float = 0.0
    general_losses: list[Loss] = field(default_factory=list)  # per held-out general text: summed NLL, tokens

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)


class WithAdapter:
    """A backend as one adapter sees it: every request carries the adapter's name."""

    def __init__(self, backend: Backend, adapter: str | None) -> None:
        self.backend = backend
        self.adapter = adapter
        self.name = backend.name
        self.models = backend.models

    async def chat(self, request: ChatRequest) -> ChatResult:
        return await self.backend.chat(replace(request, adapter=self.adapter))


class Evaluator:
    """One embedded backend for every evaluation of a process; adapters are loaded into it as needed.

    The backend starts on first use and ``pause`` closes it (its weights, merged adapters and caches) until the
    next: training, which runs between evaluations, has the memory to itself."""

    def __init__(self, settings: TrainingSettings, *, prefix_cache_mb: int | None = None) -> None:
        """``prefix_cache_mb``: the backend's prefix cache (None: the backends' default; 0: off)."""
        self.settings = settings
        cache = {} if prefix_cache_mb is None else {"prefix_cache_mb": prefix_cache_mb}
        self._backend_settings = BackendSettings(
            name="eval", kind="local", models=[settings.base_model], model_path=settings.model_path,
            max_batch_size=max(settings.eval_concurrency, 1),
            merge_lone_adapter=settings.eval_merge_adapter,
            map_large_allocations=settings.eval_map_large_allocations,
            batch_cache_mb=settings.eval_batch_cache_mb, **cache)
        self.backend: LocalBackend | None = None
        self.spread = True  # under torchrun, rank 0 hands unrecorded episodes out to every rank (``episodes``)
        self._adapters: dict[str, str] = {}  # folder -> the name it is loaded under
        self._loads = 0

    async def __aenter__(self) -> Evaluator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pause()

    async def started(self) -> LocalBackend:
        """The backend, started if it is not."""
        if self.backend is None:
            backend = LocalBackend(self._backend_settings)
            await backend.start()
            self.backend = backend
        return self.backend

    async def pause(self) -> None:
        """Close the backend until the next evaluation, and give what it held back to the system."""
        if self.backend is None:
            return
        backend, self.backend, self._adapters = self.backend, None, {}
        await backend.aclose()
        del backend
        release_free_memory()

    async def _adapter_name(self, adapter: str | Path | None) -> str | None:
        if adapter is None:
            return None
        folder = str(Path(adapter).resolve())
        if folder not in self._adapters:
            self._loads += 1
            name = f"eval-{self._loads}"
            await (await self.started()).load_adapter(name, folder)
            self._adapters[folder] = name
        return self._adapters[folder]

    async def serving(self, adapter: str | Path | None) -> tuple[Backend, TokenCounter | None]:
        """What episodes of ``adapter`` (or the base) run on, and how their context is counted."""
        engine = await self.started()
        return WithAdapter(engine, await self._adapter_name(adapter)), engine.count_tokens

    async def release(self, adapter: str | Path) -> None:
        """Unload an adapter folder's weights (a folder rewritten since, or not needed again)."""
        name = self._adapters.pop(str(Path(adapter).resolve()), None)
        if name is not None and self.backend is not None:
            await self.backend.unload_adapter(name)

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Run every episode here meanwhile: inside a training job the other ranks are in the job's collectives."""
        spread, self.spread = self.spread, False
        try:
            yield
        finally:
            self.spread = spread

    async def episodes(self, suite: Suite, tasks: list[Task], adapter: str | Path | None = None, *,
                       recorder_for: RecorderFor | None = None, temperature: float = 0.0,
                       progress: str | None = None) -> list[Episode]:
        """Run every task once; with ``recorder_for`` each episode is also recorded (e.g. into the store).

        Under torchrun, on rank 0 between training jobs, episodes that are not recorded (validation, the gate) are
        spread: each rank runs every world-size-th one on an engine of its own (``episodes_share``), and rank 0
        gathers them back in order (1.43x the episodes a minute of rank 0 alone on 2 CPU cores: ``bench/``)."""
        world = distributed.current()
        if recorder_for is None and self.spread and world is not None and world.leads:
            folder = None if adapter is None else str(Path(adapter).resolve())
            await asyncio.to_thread(distributed.lead, episodes_share, settings=self.settings, suite=suite.name,
                                    tasks=tasks, adapter=folder, temperature=temperature)
            mine = await self._run(suite, world.mine(tasks), adapter, temperature=temperature, progress=progress)
            parts = await asyncio.to_thread(world.gather, mine, during="gathering the ranks' episodes")
            return [parts[i % world.size][i // world.size] for i in range(len(tasks))]
        return await self._run(suite, tasks, adapter, recorder_for=recorder_for, temperature=temperature,
                               progress=progress)

    async def _run(self, suite: Suite, tasks: list[Task], adapter: str | Path | None, *,
                   recorder_for: RecorderFor | None = None, temperature: float = 0.0,
                   progress: str | None = None) -> list[Episode]:
        backend, token_counter = await self.serving(adapter)
        unseen = frozenset(test_only_markers(suite)["tools"])
        gate = asyncio.Semaphore(self.settings.eval_concurrency)
        bar = tqdm(total=len(tasks), desc=progress, unit="ep", disable=progress is None, leave=False)

        async def one(task: Task) -> Episode:
            async with gate:
                episode = await run_episode(suite, task, backend, model=self.settings.base_model,
                                            max_tokens=self.settings.eval_max_tokens, temperature=temperature,
                                            constrain_tool_calls=self.settings.constrain_tool_calls,
                                            unseen_tools=unseen, recorder_for=recorder_for,
                                            token_counter=token_counter,
                                            timeout_s=self.settings.episode_timeout_seconds or None)
            bar.update()
            return episode

        try:
            return list(await asyncio.gather(*(one(t) for t in tasks)))
        finally:
            bar.close()

    async def evaluate(self, suite_name: str, split: str, adapter: str | Path | None = None, *,
                       general: Callable[[str | Path | None], list[Loss]] | None = None,
                       label: str | None = None, limit: int = 0) -> Report:
        """The report of one model (the base, or ``adapter``) on one split (``limit`` > 0: that many of its tasks,
        spread evenly over it, so every family is in)."""
        suite = get_suite(suite_name, data_dir=self.settings.tasks_dir)
        return await self.evaluate_tasks(suite, spread(suite.tasks(split), limit), adapter, split=split, samples=1,
                                         temperature=0.0, general=general, label=label)

    async def evaluate_tasks(self, suite: Suite, tasks: list[Task], adapter: str | Path | None = None, *,
                             split: str, samples: int, temperature: float,
                             general: Callable[[str | Path | None], list[Loss]] | None = None,
                             label: str | None = None) -> Report:
        """The report of one model on ``tasks`` of ``suite`` (the instance that drew them: it verifies them),
        ``samples`` episodes each: one is greedy, more are sampled at ``temperature``. ``general`` gives the
        held-out general texts' losses, kept in the report and made its ``general_perplexity``."""
        started = time.perf_counter()
        episodes = await self.episodes(suite, [t for t in tasks for _ in range(samples)], adapter,
                                       temperature=temperature if samples > 1 else 0.0,
                                       progress=f"{label or adapter or 'base'} on {split}")
        metrics = metrics_of(episodes)
        losses = await asyncio.to_thread(general, adapter) if general else []
        metrics["general_perplexity"] = perplexity_of(losses) if losses else None
        return Report(model=label or (str(adapter) if adapter else "base"), suite=suite.name, split=split,
                      metrics=metrics, episodes=episodes, seconds=time.perf_counter() - started,
                      general_losses=losses)


def episodes_share(settings: TrainingSettings, suite: str, tasks: list[Task], adapter: str | None,
                   temperature: float) -> list[Episode]:
    """A rank other than 0: its share of the episodes rank 0 hands out (``Evaluator.episodes``), on an engine of its
    own that is closed again before the next training job, handed back to rank 0."""
    world = distributed.current()
    assert world is not None

    async def run() -> list[Episode]:
        async with Evaluator(settings) as evaluator:
            return await evaluator._run(get_suite(suite, data_dir=settings.tasks_dir), world.mine(tasks), adapter,
                                        temperature=temperature)

    mine = asyncio.run(run())
    world.gather(mine, during="gathering the ranks' episodes")
    return mine


def combine(reports: list[Report]) -> Report:
    """One model's reports on parts of a task set as one report: episodes in order, seconds added, the general
    losses of whichever part had them, the metrics of the whole."""
    episodes = [e for r in reports for e in r.episodes]
    losses = next((r.general_losses for r in reports if r.general_losses), [])
    metrics = metrics_of(episodes)
    metrics["general_perplexity"] = perplexity_of(losses) if losses else None
    first = reports[0]
    return Report(model=first.model, suite=first.suite, split=first.split, metrics=metrics, episodes=episodes,
                  seconds=sum(r.seconds for r in reports), general_losses=list(losses))


def spread(tasks: list[Task], count: int) -> list[Task]:
    """``count`` of ``tasks`` spread evenly over the list (all of them when ``count`` is 0 or more than there are)."""
    if not count or count >= len(tasks):
        return tasks
    return [tasks[i * len(tasks) // count] for i in range(count)]


def report_table(reports: list[Report], title: str) -> Table:
    """The reports side by side, a metric a row: what ``harness eval`` and ``harness replay-train`` print."""
    table = Table(title=title)
    table.add_column("metric")
    for report in reports:
        table.add_column(report.model, justify="right")
    for metric in METRICS:
        table.add_row(metric, *(format_value(metric, r.metrics.get(metric)) for r in reports))
        if metric == "success_rate":  # how far the rate may be from the true one, on this many tasks
            intervals = [success_interval(r.episodes) for r in reports]
            table.add_row("  95% interval", *("-" if i is None else f"{i[0]:.0%}–{i[1]:.0%}" for i in intervals))
    table.add_row("episodes", *(str(len(r.episodes)) for r in reports))
    table.add_row("seconds", *(f"{r.seconds:.0f}" for r in reports))
    return table


def write_reports(reports: list[Report], out: Path, *, title: str) -> tuple[Path, Path]:
    """The reports as JSON and as a PNG bar chart, one group of bars per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "eval.json", out / "eval.png"
    json_path.write_bytes(orjson.dumps([asdict(r) for r in reports], option=orjson.OPT_INDENT_2))
    rates = [m for m in METRICS if m not in ("mean_steps", "general_perplexity")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [len(rates), 1, 1]})
    width = 0.8 / max(len(reports), 1)
    for panel, names in zip(axes, (rates, ["mean_steps"], ["general_perplexity"]), strict=True):
        for i, report in enumerate(reports):
            values = [report.metrics.get(n) or 0.0 for n in names]
            xs = [x + i * width for x in range(len(names))]
            panel.bar(xs, values, width, label=report.model)
        panel.set_xticks([x + width * (len(reports) - 1) / 2 for x in range(len(names))])
        panel.set_xticklabels([n.replace("_", "\n") for n in names], fontsize=8)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
