"""``harness replay-train --mode sft``: the agent gets better from its own traffic, or nothing changes.

    select → reward → build → train → validate (pick the checkpoint) → test (gate) → register → publish

1. select: the trajectories the replay filters name (without the reward bounds, which apply after step 2);
2. reward: the reward engine scores them (``[rewards]``), so ``--min-reward`` sees fresh totals;
3. build: one SFT row per model call of the selected trajectories, rendered exactly as the embedded backend
   prompts; rows holding test-split material are dropped; recovered trajectories are repeated up to
   ``min_recovered_share`` and general rows mixed in at ``general_share``;
4. train: LoRA SFT (``[training]``), ``checkpoints`` evenly spaced checkpoints;
5. validate: every checkpoint on the suite's validation split; the best (success, then valid calls, then
   fewer invalid calls) is the candidate;
6. test: candidate and reference (the adapter's active version, else the base) on the test split, plus the
   general check; the gate compares them;
7. register: the candidate becomes a new version of the adapter in the store's registry, its numbers and the
   gate's decision stored with it; promoted if it passed;
8. publish: with ``--publish URL``, a passing candidate is registered on that gateway instead (uploaded with
   its numbers), published and promoted through its admin routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console

from gateway.adapters import archive
from gateway.adapters.registry import AdapterRegistry, AdapterVersion
from gateway.backends.local_model import load_tokenizer
from gateway.config import Settings
from replay.filters import Filters
from replay.rewards import recompute
from replay.store import TrajectoryStore
from training import data
from training.evaluate import Evaluator, Report, write_reports
from training.gate import Decision, decide
from training.general import GeneralCheck
from training.sft import SFTConfig, train_sft
from training.tasks import Suite, get_suite, test_only_markers


class ReplayTrainError(Exception):
    """A stage that cannot go on; the message says why, for a person."""


@dataclass
class Outcome:
    run_dir: Path
    registered: AdapterVersion | None = None
    decision: Decision | None = None
    published: bool = False


def leak_filter(suite: Suite) -> Callable[[str], bool]:
    """Whether a training row's text holds test-split material: a test prompt or a test-only tool."""
    markers = test_only_markers(suite)
    needles = [*markers["prompts"], *markers["tools"]]
    return lambda text: any(n in text for n in needles)


def _rank(report: Report) -> tuple[float, float, float]:
    m = report.metrics
    return (m.get("success_rate") or 0.0, m.get("valid_call_rate") or 0.0, -(m.get("invalid_call_rate") or 0.0))


async def replay_train(settings: Settings, filters: Filters, *, name: str | None = None, publish: str | None = None,
                       console: Console | None = None) -> Outcome:
    console = console or Console()
    training = settings.training
    suite = get_suite(training.suite)
    name = name or suite.name
    run_dir = Path(training.output_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(run_dir=run_dir)
    started = time.perf_counter()

    def stage(label: str, detail: str) -> None:
        console.print(f"[bold]{label:<9}[/bold] {detail}  [dim]({time.perf_counter() - started:.0f} s)[/dim]")

    # -- select and reward --------------------------------------------------------------------------------
    unbounded = dataclasses.replace(filters, min_reward=None, max_reward=None)
    store = TrajectoryStore(settings.store.path, synchronous=settings.store.synchronous)
    await store.start()
    try:
        selected = await store.select_ids(unbounded)
        if not selected:
            raise ReplayTrainError("no trajectories match the filters; capture some first "
                                   "(harness tasks capture) or widen the filters")
        stage("select", f"{len(selected)} trajectories")
        summary = await recompute(store, unbounded, settings.rewards,
                                  step_limits={p.name: p.max_steps for p in settings.profiles})
        mean = "-" if summary.mean_reward is None else f"{summary.mean_reward:.3f}"
        stage("reward", f"{summary.count} scored, mean reward {mean}")
    finally:
        await store.close()

    # -- build ----------------------------------------------------------------------------------------------
    tokenizer = await asyncio.to_thread(load_tokenizer, training.model_path)
    task_rows, stats = await asyncio.to_thread(data.examples_from_store, settings.store.path, filters, tokenizer,
                                               max_seq_len=training.max_seq_len, exclude=leak_filter(suite))
    if not task_rows:
        raise ReplayTrainError("the selected trajectories hold no model call to train on (with --min-reward, "
                               "are any rewarded that high?)")
    general = GeneralCheck(training)
    general_rows = data.general_examples(tokenizer, await asyncio.to_thread(general.training_conversations),
                                         training.max_seq_len)
    rows = data.mix(task_rows, general_rows, min_recovered_share=training.min_recovered_share,
                    general_share=training.general_share, seed=training.seed)
    stage("build", f"{len(rows)} rows: {len(task_rows)} from trajectories ({stats.recovered} recovered, "
                   f"{stats.excluded} dropped for test-split material), general share {training.general_share:.0%}")

    # -- train ----------------------------------------------------------------------------------------------
    result = await asyncio.to_thread(train_sft, training.model_path, rows, SFTConfig.from_settings(training),
                                     run_dir)
    result.model = None  # evaluation loads the checkpoints into its own backend; free the training copy first
    stage("train", f"{len(result.checkpoints)} checkpoints, {result.tokens:,} tokens in {result.seconds:.0f} s "
                   f"({result.tokens_per_second:,.0f} tokens/s)")

    # -- validate, test, gate ---------------------------------------------------------------------------------
    registry = AdapterRegistry(settings.store.path)
    active = await asyncio.to_thread(registry.active, name)
    reference = active.path if active else None
    reference_label = active.backend_name if active else "base"
    async with Evaluator(training) as evaluator:
        validation = []
        for checkpoint in result.checkpoints:
            validation.append(await evaluator.evaluate(suite.name, "validation", checkpoint,
                                                       label=checkpoint.name))
        best = max(range(len(validation)), key=lambda i: _rank(validation[i]))
        candidate = result.checkpoints[best]
        stage("validate", ", ".join(f"{r.model}: success {r.metrics['success_rate']:.0%}" for r in validation)
              + f" → {candidate.name}")
        before = await evaluator.evaluate(suite.name, "test", reference, general=general.perplexity,
                                          label=reference_label)
        after = await evaluator.evaluate(suite.name, "test", candidate, general=general.perplexity,
                                         label=f"{name} (candidate)")
    decision = decide(after.metrics, before.metrics, training.gate)
    outcome.decision = decision
    write_reports([before, after], run_dir, title=f"{suite.name} / test: before and after")
    stage("test", "gate passed" if decision.passed else
          "gate refused: " + ", ".join(f"{c.metric} {c.reference:.3g} → {c.candidate}" for c in decision.failures()))

    # -- register and publish ------------------------------------------------------------------------------------
    metrics: dict[str, Any] = {"test": after.metrics, "reference": {"model": reference_label, **before.metrics},
                               "validation": validation[best].metrics, "gate": decision.as_dict(),
                               "run_dir": str(run_dir), "checkpoint": candidate.name}
    if publish and decision.passed:
        # The running gateway's registry is the one that matters: the version is registered there, with its numbers.
        card = await asyncio.to_thread(_publish, publish, name, training.base_model, candidate, metrics)
        outcome.registered = AdapterVersion(**{k: card[k] for k in AdapterVersion.__dataclass_fields__})
        outcome.published = True
        stage("publish", f"{card['backend_name']} uploaded, published and promoted on {publish}")
    else:
        version = await asyncio.to_thread(registry.register, name, training.base_model, str(candidate.resolve()),
                                          metrics=metrics)
        if decision.passed:
            version, _ = await asyncio.to_thread(registry.promote, name, version.version)
        outcome.registered = version
        stage("register", f"{version.backend_name} ({version.status}) in {settings.store.path}"
              + ("; not published: the gate refused it" if publish else ""))

    from training.cli import print_reports

    print_reports([before, after], f"{suite.name} / test: before and after")
    return outcome


def _publish(url: str, name: str, base: str, folder: Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """Upload, publish and promote on a running gateway; its card of the promoted version."""
    key = os.environ.get("HARNESS_ADMIN_KEY")
    if not key:
        raise ReplayTrainError("--publish needs the gateway's admin key in HARNESS_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600.0) as client:
        response = client.post("/admin/adapters", content=archive.pack(folder),
                               params={"name": name, "base": base, "metrics": orjson.dumps(metrics).decode()},
                               headers={"Content-Type": "application/gzip"})
        _check(response)
        version = response.json()["version"]
        for action in ("publish", "promote"):
            response = client.post(f"/admin/adapters/{name}/{action}", json={"version": version})
            _check(response)
        return response.json()


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise ReplayTrainError(f"the gateway answered {response.status_code}: {message}")
