"""The gate's evaluations: the reference and the candidates on the gate's tasks, in one look or several.

With ``[training.gate] looks`` empty, every model runs every gate task and the gate decides once (the fixed-size
rule; the reference's report from the cache when it is there). With looks, e.g. ``[40, 70]``, the tasks run in
blocks (``gate.order_for_looks``: the first block holds the faulted tasks the recovery check needs, every block the
families in turn) and the gate decides after each at that look's spent confidence (``gate.spending``), stopping as
soon as the decision is settled: every check passed, or one failed beyond noise. A clearly better candidate is
published after its first block; a borderline one runs them all, at a stricter last look than the fixed-size rule.
A reference evaluated here block by block is cached only once it has run every task.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from training.evaluate import Evaluator, Report, combine
from training.gate import Decision, baselines, decide, decide_at_look, look_points, order_for_looks, spending
from training.metrics import Loss
from training.references import ReferenceCache, reference_key, reference_report
from training.settings import TrainingSettings
from training.stages import Stages
from training.tasks import Suite, Task


async def gate_reports(evaluator: Evaluator, cache: ReferenceCache, suite: Suite, tasks: list[Task],
                       reference: Path | None, columns: list[tuple[Path | None, str]], settings: TrainingSettings, *,
                       reference_label: str, solver_steps: dict[str, int],
                       general: Callable[[str | Path | None], list[Loss]] | None,
                       stage: Stages) -> tuple[list[Report], Decision]:
    """The reference's report, then each of ``columns``' (model, label; the candidate last), on the tasks the gate
    ran, and the gate's decision between the reference and the candidate."""
    gate = settings.gate
    points = look_points(gate)
    if len(points) == 1:
        before, cached = await reference_report(evaluator, cache, suite, tasks, reference, settings,
                                                label=reference_label, general=general)
        stage("reference", f"{reference_label}: its gate report " + ("from the cache" if cached else
              f"evaluated on {len(tasks)} gate tasks"), episodes=0 if cached else len(before.episodes))
        reports = [before] + [await _evaluate(evaluator, suite, tasks, model, label, settings, general)
                              for model, label in columns]
        stage("evaluate", ", ".join(f"{r.model}: success {r.metrics['success_rate']:.0%}" for r in reports[1:]),
              episodes=sum(len(r.episodes) for r in reports[1:]))
        decision = decide(reports[-1], before, baselines=baselines(suite, tasks), solver_steps=solver_steps,
                          gate=gate)
        return reports, decision

    ordered = order_for_looks(tasks, points[0], gate.min_faulted, gate.min_direct)
    key = await asyncio.to_thread(reference_key, suite, tasks, reference, settings)
    cached = await asyncio.to_thread(cache.get, key)
    confidences = spending(points, gate.confidence)
    parts: list[list[Report]] = [[] for _ in range(len(columns) + 1)]
    decision: Decision | None = None
    done = 0
    for look, (count, confidence) in enumerate(zip(points, confidences, strict=True)):
        block = ordered[done:count]
        first = general if done == 0 else None  # the general check does not depend on the tasks: once per model
        if cached is None:
            parts[0].append(await _evaluate(evaluator, suite, block, reference, reference_label, settings, first))
        for i, (model, label) in enumerate(columns, 1):
            parts[i].append(await _evaluate(evaluator, suite, block, model, label, settings, first))
        done = count
        seen = {t.id for t in ordered[:done]}
        before = _slice(cached, seen, reference_label) if cached is not None else combine(parts[0])
        candidate = combine(parts[-1])
        decision, settled = decide_at_look(candidate, before, baselines=baselines(suite, ordered[:done]),
                                           solver_steps=solver_steps, gate=gate, look=look, confidence=confidence,
                                           history=decision.looks if decision else [])
        stage("gate look", f"{done} tasks, {confidence:.2%} bounds: {decision.looks[-1]['outcome']} "
                           f"({candidate.model} {candidate.metrics['success_rate']:.0%} against "
                           f"{before.model} {before.metrics['success_rate']:.0%})",
              episodes=sum(len(p[-1].episodes) for p in parts if p))
        if settled:
            break
    assert decision is not None
    if cached is None and done == len(ordered):
        await asyncio.to_thread(cache.put, key, combine(parts[0]))
    before = _slice(cached, {t.id for t in ordered[:done]}, reference_label) if cached is not None \
        else combine(parts[0])
    return [before, *(combine(p) for p in parts[1:])], decision


async def _evaluate(evaluator: Evaluator, suite: Suite, tasks: list[Task], model: Path | None, label: str,
                    settings: TrainingSettings, general: Callable[[str | Path | None], list[Loss]] | None) -> Report:
    gate = settings.gate
    return await evaluator.evaluate_tasks(suite, tasks, model, split="gate", samples=gate.samples,
                                          temperature=gate.temperature, general=general, label=label)


def _slice(report: Report, task_ids: set[str], label: str) -> Report:
    """The cached reference's report on the tasks a sequential gate has run so far."""
    return combine([dataclasses.replace(report, model=label,
                                        episodes=[e for e in report.episodes if e.task_id in task_ids])])
