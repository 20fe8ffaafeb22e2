"""``harness replay-train --mode sft|rl|sft+rl``: the agent gets better from its own traffic, or nothing changes.

    select → reward → [build → train → validate] → [RL] → test (gate) → register → publish

1. select: the trajectories the replay filters name (without the reward bounds, which apply after step 2);
2. reward: the reward engine scores them (``[rewards]``), so ``--min-reward`` sees fresh totals;
3. build (sft): one SFT row per selected trajectory (every valid assistant turn labelled; a row per model call
   where the history was rewritten or the row is too long), rendered exactly as the embedded backend prompts;
   invalid calls are context, never labels; rows holding test-split material are dropped; recovered
   trajectories are repeated up to ``min_recovered_share`` and general rows mixed in at ``general_share``;
4. train (sft): LoRA SFT (``[training]``), ``checkpoints`` evenly spaced checkpoints;
5. validate (sft): every checkpoint on the suite's validation split; the best (success, then valid calls, then
   fewer invalid calls) is the candidate;
5a. on-policy correction (sft, sft+rl; ``training/correction.py``, ``[training.correction] rounds``): the
   candidate's own episodes on train tasks, each state where its turn differs from the teacher's (the suite's
   solver, or ``--teacher MODEL`` through a gateway) labelled with the teacher's turn and trained on (DAgger); a
   round's checkpoint replaces the candidate when validation ranks it higher;
5b. expert iteration (sft, sft+rl; ``training/expert.py``, ``[training.expert] rounds``): the candidate's own
   verified, clean episodes on train tasks it does not always solve, trained on from it; a round's checkpoint
   replaces the candidate when validation ranks it higher;
6. RL (rl, sft+rl; ``training/rl.py``): from the SFT candidate, or ``--init``, or the adapter's active version:
   the selected trajectories' groups with captured log-probabilities first, then ``[training.rl] steps`` of
   online rollouts; validation keeps the best checkpoint, rolls back, or stops the run on the reward-hacking alarm;
7. test: candidate and reference (the adapter's active version, else the base), and what RL started from when that
   is neither, on the gate's tasks (``[training.gate]``: drawn with a fixed seed from the test templates), plus
   the general check; the gate (``training/gate.py``) decides by one-sided bounds of their paired differences;
8. register: the candidate becomes a new version of the adapter in the store's registry, its numbers and the
   gate's decision stored with it; promoted if it passed;
9. publish: with ``--publish URL``, a passing candidate is registered on that gateway instead (uploaded with
   its numbers), published and promoted through its admin routes.

With ``--gateway URL`` every episode (correction and expert rounds, rollouts, validation, the gate) runs through
that gateway's backends instead of the in-process engine (``training/on_gateway.py``).

The run has a row in the store (``training/run_record.py``) from its start: each stage as it ends, then its curves,
before/after table and gate decision, or why it failed; the console's training pages read it from any host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console

from gateway.adapters import archive
from gateway.backends.local.loading import load_tokenizer
from gateway.config import ServerSettings
from replay.adapters import AdapterRegistry, AdapterVersion
from replay.database import redact_url
from replay.filters import Filters
from replay.rewards import recompute, signal_weights, step_limits
from replay.store import TrajectoryStore
from training import data
from training.correction import correction_rounds
from training.evaluate import Evaluator, report_table, write_reports
from training.expert import expert_iteration
from training.gate import Decision, decision_table, solver_steps
from training.gating import gate_reports
from training.general import GeneralCheck
from training.groups import Group, similar_batches
from training.metrics import rank
from training.on_gateway import GatewayEvaluator, error_message
from training.references import ReferenceCache
from training.rl import RLConfig, RLResult, train_rl
from training.rollouts import Rollouts, groups_from_store
from training.rounds import train_apart
from training.run_record import RunRecord
from training.settings import CorrectionSettings, HarnessSettings
from training.sft import SFTConfig, SFTResult, load_base
from training.stages import Stages
from training.tasks import Suite, Task, get_suite, leak_filter
from training.teacher import ServedTeacher, SolverTeacher, Teacher

MODES = ("sft", "rl", "sft+rl")


class ReplayTrainError(Exception):
    """A stage that cannot go on; the message says why, for a person."""


@dataclass
class Outcome:
    run_dir: Path
    run_id: str | None = None  # its row in the store's training runs (None: the store could not be written)
    registered: AdapterVersion | None = None
    decision: Decision | None = None
    published: bool = False


async def replay_train(settings: HarnessSettings, filters: Filters, *, mode: str = "sft", init: str | None = None,
                       name: str | None = None, publish: str | None = None, gateway: str | None = None,
                       console: Console | None = None) -> Outcome:
    """The whole pipeline (see the module doc). ``mode``: sft, rl or sft+rl; ``init``: the adapter folder RL starts
    from in ``rl`` mode, or ``"base"`` for a fresh adapter (default: the adapter's active version, else fresh)."""
    if mode not in MODES:
        raise ReplayTrainError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    console = console or Console()
    training = settings.training
    suite = get_suite(training.suite, data_dir=training.tasks_dir)
    name = name or suite.name
    run_dir = Path(training.output_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    record = await RunRecord.start(settings.store, name=name, mode=mode, run_dir=run_dir)
    stage = Stages(console, on_stage=record.stage_ended)
    try:
        return await _pipeline(settings, filters, mode=mode, init=init, name=name, publish=publish, gateway=gateway,
                               console=console, suite=suite, run_dir=run_dir, stage=stage, record=record)
    except BaseException as exc:  # an interrupted run too: its row must not say it is still running
        await record.fail(exc, stage.records)
        raise


async def _pipeline(settings: HarnessSettings, filters: Filters, *, mode: str, init: str | None, name: str,
                    publish: str | None, gateway: str | None, console: Console, suite: Suite, run_dir: Path,
                    stage: Stages, record: RunRecord) -> Outcome:
    """Select to publish (see the module doc), into ``run_dir``, each stage through ``stage``."""
    training = settings.training
    outcome = Outcome(run_dir=run_dir, run_id=record.run_id)
    gate = training.gate
    gate_tasks = suite.draw("test", gate.tasks, seed=gate.seed, min_faulted=gate.min_faulted,
                            min_direct=gate.min_direct)

    # -- select and reward --------------------------------------------------------------------------------
    unbounded = dataclasses.replace(filters, min_reward=None, max_reward=None)
    store = TrajectoryStore(settings.store.location, settings.store)
    await store.start()
    try:
        selected = await store.select_ids(unbounded)
        if not selected and (mode != "rl" or not training.rl.steps):
            raise ReplayTrainError("no trajectories match the filters; capture some first "
                                   "(harness tasks capture) or widen the filters")
        stage("select", f"{len(selected)} trajectories", trajectories=len(selected))
        if selected:
            summary = await recompute(store, unbounded, settings.rewards,
                                      step_limits=step_limits(settings.profiles))
            mean = "-" if summary.mean_reward is None else f"{summary.mean_reward:.3f}"
            stage("reward", f"{summary.count} scored, mean reward {mean}", trajectories=summary.count)
    finally:
        await store.close()

    registry = AdapterRegistry(settings.store.location)
    active = await asyncio.to_thread(registry.active, name)
    reference = Path(active.path) if active else None
    reference_label = active.backend_name if active else "base"
    general = GeneralCheck(training)
    expert_rounds: list[dict[str, Any]] | None = None
    correction_rounds_done: list[dict[str, Any]] | None = None
    evaluator = Evaluator(training) if gateway is None else GatewayEvaluator(
        training, gateway, settings.server.admin_key, run=run_dir.name, key_env=settings.server.admin_key_env)
    async with evaluator:
        if "sft" in mode:
            candidate, validation, demonstrations = await _sft(settings, filters, suite, gate_tasks, general,
                                                               evaluator, run_dir / "sft" if "rl" in mode else run_dir,
                                                               stage, record)
            if training.correction.rounds:
                teacher = teacher_of(training.correction)
                try:
                    candidate, validation, correction_rounds_done = await correction_rounds(
                        settings, suite, evaluator, general, candidate, validation, run_dir / "correction",
                        teacher=teacher, demonstrations=demonstrations, exclude=leak_filter(suite, gate_tasks),
                        stage=stage)
                finally:
                    if isinstance(teacher, ServedTeacher):
                        await teacher.aclose()
                record.rounds("correction", correction_rounds_done)
            if training.expert.rounds:
                candidate, validation, expert_rounds = await expert_iteration(
                    settings, suite, evaluator, general, candidate, validation, run_dir / "expert",
                    demonstrations=demonstrations, exclude=leak_filter(suite, gate_tasks), stage=stage)
                record.rounds("expert", expert_rounds)
        else:
            candidate = None if init == "base" else Path(init) if init else reference
            validation = {}
        start = candidate  # what RL starts from
        rl_summary: dict[str, Any] | None = None
        if "rl" in mode:
            candidate, validation, rl_summary = await _rl(settings, selected, start, evaluator, run_dir, stage,
                                                          record)
        if candidate is None or candidate == reference:
            raise ReplayTrainError("nothing new to register: RL found no checkpoint better on validation than the "
                                   "adapter it started from, which is the one serving now")

        # -- test and gate ------------------------------------------------------------------------------------
        # Both on the same gate tasks, in one look or several (training/gating.py); the reference's report comes
        # from the cache while its weights, the tasks and the settings are the same.
        # What RL started from gets its own column when it is neither the reference nor the candidate.
        columns = [(start, "before RL")] if "rl" in mode and start not in (None, reference, candidate) else []
        columns.append((candidate, f"{name} (candidate)"))
        reports, decision = await gate_reports(
            evaluator, ReferenceCache(Path(training.output_dir) / "references"), suite, gate_tasks, reference,
            columns, training, reference_label=reference_label, solver_steps=await solver_steps(suite, gate_tasks),
            general=general.losses, stage=stage)
    before, after = reports[0], reports[-1]
    outcome.decision = decision
    title = f"{suite.name} / {decision.tasks} gate tasks (seed {gate.seed}): before and after"
    write_reports(reports, run_dir, title=title)
    stage("gate", decision.summary())

    # -- register and publish ------------------------------------------------------------------------------------
    metrics: dict[str, Any] = {"mode": mode, "test": after.metrics,
                               "reference": {"model": reference_label, **before.metrics},
                               "validation": validation, "gate": decision.as_dict(), "run_dir": str(run_dir),
                               "checkpoint": str(candidate.relative_to(run_dir)) if candidate.is_relative_to(run_dir)
                               else str(candidate), "stages": stage.records}
    if len(reports) == 3:
        metrics["before_rl"] = {"model": reports[1].model, **reports[1].metrics}
    if correction_rounds_done is not None:
        metrics["correction"] = correction_rounds_done
    if expert_rounds is not None:
        metrics["expert"] = expert_rounds
    if rl_summary is not None:
        metrics["rl"] = rl_summary
    if publish and decision.passed:
        # The running gateway's registry is the one that matters: the version is registered there, with its numbers.
        card = await asyncio.to_thread(_publish, settings.server, publish, name, training.base_model, candidate,
                                       metrics)
        outcome.registered = AdapterVersion(**{k: card[k] for k in AdapterVersion.__dataclass_fields__})
        outcome.published = True
        stage("publish", f"{card['backend_name']} uploaded, published and promoted on {publish}")
    else:
        version = await asyncio.to_thread(registry.register, name, training.base_model, str(candidate.resolve()),
                                          metrics=metrics)
        if decision.passed:
            version, _ = await asyncio.to_thread(registry.promote, name, version.version)
        outcome.registered = version
        stage("register", f"{version.backend_name} ({version.status}) in {redact_url(settings.store.location)}"
              + ("; not published: the gate refused it" if publish else ""))

    # The registry holds the stages up to the gate (its numbers go up with the version); the run folder all of them.
    (run_dir / "stages.json").write_bytes(orjson.dumps(stage.records, option=orjson.OPT_INDENT_2))
    await record.finish(stage.records, reports=reports, decision=decision, registered=outcome.registered,
                        published=outcome.published, rl=rl_summary, expert=expert_rounds,
                        correction=correction_rounds_done)
    console.print(report_table(reports, title))
    console.print(decision_table(decision, before.model, after.model))
    console.print(stage.table())
    return outcome



def teacher_of(correction: CorrectionSettings) -> Teacher:
    """The solver, or the served model ``[training.correction] teacher`` names, asked through ``teacher_url``."""
    if correction.teacher == "solver":
        return SolverTeacher()
    return ServedTeacher(correction.teacher_url, correction.teacher, api_key=correction.teacher_key)


async def _sft(settings: HarnessSettings, filters: Filters, suite: Suite, gate_tasks: list[Task], general: GeneralCheck,
               evaluator: Evaluator, out: Path, stage: Stages,
               record: RunRecord) -> tuple[Path, dict[str, Any], list[data.Example]]:
    """Build, train (into ``out``) and validate: the best SFT checkpoint, its validation metrics (none when there
    is one checkpoint and no expert iteration, which would rank against them) and the task rows it trained on."""
    training = settings.training
    tokenizer = await asyncio.to_thread(load_tokenizer, training.model_path)
    task_rows, stats = await asyncio.to_thread(data.examples_from_store, settings.store.location, filters, tokenizer,
                                               max_seq_len=training.max_seq_len, exclude=leak_filter(suite, gate_tasks),
                                               rendering=training.tool_rendering)
    if not task_rows:
        raise ReplayTrainError("the selected trajectories hold no model call to train on (with --min-reward, "
                               "are any rewarded that high?)")
    general_rows = await asyncio.to_thread(general.training_rows)
    rows = data.mix(task_rows, general_rows, min_recovered_share=training.min_recovered_share,
                    general_share=training.general_share, seed=training.seed)
    stage("build", f"{len(rows)} rows: {len(task_rows)} from {stats.trajectories} trajectories ({stats.merged} "
                   f"as one row, {stats.recovered} recovered, {stats.masked} turns with invalid calls masked, "
                   f"{stats.excluded} dropped for test-split material), general share {training.general_share:.0%}",
          rows=len(rows))

    general.release()  # its copy of the base comes back when the gate next asks
    result = await train_apart(evaluator, training.model_path, rows, SFTConfig.from_settings(training), out)
    stage("sft", f"{len(result.checkpoints)} checkpoints, {result.tokens:,} tokens in {result.seconds:.0f} s "
                   f"({result.tokens_per_second:,.0f} tokens/s){on_ranks(result)}", tokens=result.tokens)
    if len(result.checkpoints) == 1 and not training.expert.rounds and not training.correction.rounds:
        record.sft(result.losses, [])
        stage("validate", f"skipped: one checkpoint ({result.checkpoints[0].name}) and no correction or expert "
                          "round to rank against")
        return result.checkpoints[0], {}, task_rows
    validation = [await evaluator.evaluate(suite.name, "validation", checkpoint, label=checkpoint.name)
                  for checkpoint in result.checkpoints]
    record.sft(result.losses, validation)
    best = max(range(len(validation)), key=lambda i: rank(validation[i].metrics))
    stage("validate", ", ".join(f"{r.model}: success {r.metrics['success_rate']:.0%}" for r in validation)
          + f" → {result.checkpoints[best].name}", episodes=sum(len(r.episodes) for r in validation))
    return result.checkpoints[best], validation[best].metrics, task_rows


async def _rl(settings: HarnessSettings, selected: list[str], start: Path | None, evaluator: Evaluator, run_dir: Path,
              stage: Stages, record: RunRecord) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Captured groups first, then online rollouts: the best checkpoint on validation, its metrics, a summary."""
    training, rl = settings.training, settings.training.rl
    suite = get_suite(training.suite, data_dir=training.tasks_dir)
    test_tasks = {t.id for t in suite.tasks("test")}
    loop = asyncio.get_running_loop()
    store = TrajectoryStore(settings.store.location, settings.store)
    await store.start()
    try:
        captured, stats = await groups_from_store(
            store, selected, signal_weights(settings.rewards), base_model=training.base_model,
            step_limits=step_limits(settings.profiles), outcome=rl.outcome)
        captured = [g for g in captured if g.task_id not in test_tasks]
        stage("groups", stats.describe())
        batches = similar_batches(captured, rl.tasks_per_step, training.seed)
        steps = len(batches) + rl.steps
        if not steps:
            raise ReplayTrainError("RL has nothing to train on: the selected trajectories form no group with "
                                   "captured log-probabilities, and [training.rl] steps is 0")
        rollouts = Rollouts(settings, evaluator, store, run=run_dir.name)

        def next_batch(step: int, policy: Path) -> list[Group]:
            if step <= len(batches):
                return batches[step - 1]
            return asyncio.run_coroutine_threadsafe(rollouts.collect(step, policy), loop).result()

        async def validation(folder: Path) -> dict[str, Any]:
            with evaluator.alone():  # called from inside RL's training job
                report = await evaluator.evaluate(suite.name, "validation", folder, limit=rl.validation_tasks,
                                                  label=folder.name)
            await evaluator.release(folder)
            return report.metrics

        def validate(folder: Path) -> dict[str, Any]:
            return asyncio.run_coroutine_threadsafe(validation(folder), loop).result()

        loaded = await asyncio.to_thread(load_base, training.model_path)
        result = await asyncio.to_thread(train_rl, loaded, RLConfig.from_settings(training), run_dir / "rl",
                                         steps=steps, batches=next_batch, validate=validate, init_adapter=start)
        result.model = None
        del loaded
    finally:
        await store.close()
    record.rl(result.history, result.validations)
    best = next(v for v in result.validations if v["checkpoint"] == str(result.best))
    stage("rl", f"{len(result.history)} steps ({len(batches)} on captured groups), {result.groups} groups "
                f"({result.flat_groups} without reward spread), {rollouts.episodes} rollouts in "
                f"{rollouts.seconds:.0f} s, "
                f"{result.tokens:,} tokens in {result.seconds:.0f} s ({result.tokens_per_second:,.0f} tokens/s"
                f"{on_ranks(result)}), "
                f"{result.rollbacks} rollbacks" + (f", stopped: {result.stopped}" if result.stopped else "")
                + f" → {result.best.name}",
          tokens=result.tokens, episodes=rollouts.episodes)
    summary = {"steps": len(result.history), "captured_steps": len(batches), "best_step": result.best_step,
               "stopped": result.stopped, "rollbacks": result.rollbacks, "groups": result.groups,
               "flat_groups": result.flat_groups, "rollouts": rollouts.episodes,
               "rollout_groups": dataclasses.asdict(rollouts.stats), "skipped_samples": result.skipped_samples,
               "validations": [{k: v[k] for k in ("step", "metrics", "action", "reward_rise")}
                               for v in result.validations]}
    # Checkpoint 0 is the starting adapter saved again: the start itself is the candidate then.
    candidate = result.best if result.best_step or start is None else start
    return candidate, best["metrics"], summary


def _publish(server: ServerSettings, url: str, name: str, base: str, folder: Path,
             metrics: dict[str, Any]) -> dict[str, Any]:
    """Upload, publish and promote on a running gateway; its card of the promoted version."""
    key = server.admin_key
    if not key:
        raise ReplayTrainError(f"--publish needs the gateway's admin key in {server.admin_key_env}")
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
        raise ReplayTrainError(f"the gateway answered {response.status_code}: {error_message(response)}")


def on_ranks(result: SFTResult | RLResult) -> str:
    """Where a training job ran, when not in this one process: `` on 2 ranks`` (``, FSDP``)."""
    if result.ranks == 1:
        return ""
    return f" on {result.ranks} ranks" + (", FSDP" if result.sharded else "")
