"""The gate: a candidate replaces the reference (the active adapter, else the base) only when it is better beyond
noise and no worse beyond a margin, judged on the same gate tasks.

Both run the same tasks (drawn with a fixed seed from the suite's test templates, ``ToolsSuite.draw``), so every
comparison is paired: per task, the candidate's outcome minus the reference's. A bound is one-sided at
``[training.gate] confidence`` (95%), by the paired bootstrap over tasks with the gate's seed
(``training/stats.py``). The candidate passes only if every check below passes:

- ``success gain``: the lower bound of the paired success difference is above 0;
- ``over <policy>``: the lower bound of the candidate's success rate (Wilson) is above the success rate
  of each trivial policy on the same tasks (``always_refuse``, ``never_call``: a model that only learnt to refuse
  or to guess must not pass, however weak the reference);
- ``invalid-call rise``: the upper bound of the rise in the invalid-call rate (invalid calls over calls; a side
  without calls counts 0, so against a reference that hardly calls a tool the candidate's own rate is bounded)
  is at most ``invalid_call_rate``;
- ``abstention drop``: pooled over the tasks no offered tool fits (at least ``min_direct`` of them), the lower bound
  of the paired difference in answering without a call (``metrics.answered_directly``, right or wrong) is at least
  ``-abstention_rate`` (a candidate that learnt to call a tool for everything must not pass);
- ``recovery drop``: pooled over the faulted tasks (at least ``min_faulted`` of them), the lower bound of the
  paired success difference is at least ``-recovery_rate``;
- ``excess steps``: on the tasks both solved, steps beyond the solver's (fewer than the solver's count as none,
  so a lucky shortcut of the reference is no standard), the upper bound of the paired rise is at most
  ``mean_steps``;
- ``perplexity rise``: over the held-out general texts, the upper bound of the candidate's perplexity over the
  reference's, minus 1, is at most ``general_perplexity``.

A check with nothing to judge (no faulted task, no task both solved, no general data) is recorded as skipped.
Every figure is kept in the ``Decision``: stored with the version in the registry and printed as a table.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from rich.table import Table

from training.metrics import Episode, Loss, answered_directly, perplexity_of
from training.settings import GateSettings
from training.stats import mean, paired_bootstrap, rate_bounds
from training.tasks import Suite, Task
from training.tasks.adversarial import POLICIES

TRIVIAL_POLICIES = ("always_refuse", "never_call")  # they answer at once: their outcome is a function of the task

class Evaluated(Protocol):
    """What the gate reads of an evaluation (``training.evaluate.Report``)."""

    episodes: list[Episode]
    general_losses: list[Loss]


@dataclass(frozen=True)
class Check:
    name: str
    reference: float | None  # each side's own figure, for the table
    candidate: float | None
    estimate: float | None  # the compared statistic (a difference, or a rate)
    bound: float | None  # its one-sided bound ("lower" or "upper" of ``side``)
    side: str
    threshold: float
    relation: str  # how the bound must stand to the threshold: ">", "≥" or "≤"
    n: int  # the tasks (or texts) it rests on
    passed: bool
    note: str = ""
    opposite: float | None = None  # the other one-sided bound, at the same confidence: whether a failure is settled

    @property
    def skipped(self) -> bool:
        return self.bound is None

    @property
    def settled_failure(self) -> bool:
        """Whether the check fails beyond noise: its other bound already lies on the wrong side of the threshold, so
        more tasks would not make it pass (a sequential gate stops there)."""
        if self.passed or self.opposite is None:
            return False
        if self.side == "lower":
            return self.opposite <= self.threshold if self.relation == ">" else self.opposite < self.threshold
        return self.opposite > self.threshold


@dataclass(frozen=True)
class Decision:
    passed: bool
    checks: list[Check]
    tasks: int
    samples: int
    confidence: float
    seed: int
    looks: list[dict[str, Any]] = field(default_factory=list)  # a sequential gate's looks: tasks, confidence, outcome

    @property
    def settled_failure(self) -> bool:
        return any(c.settled_failure for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "tasks": self.tasks, "samples": self.samples, "confidence": self.confidence,
                "seed": self.seed, "checks": [asdict(c) for c in self.checks], "looks": self.looks}

    def summary(self) -> str:
        if self.passed:
            return "gate passed"
        return "gate refused: " + "; ".join(f"{c.name} {_bound_text(c)}" for c in self.failures())


@dataclass(frozen=True)
class _Pair:
    """One gate task: both sides' outcomes (shares of their samples where there are several)."""

    task_id: str
    faulted: bool
    direct: bool
    solver_steps: int
    candidate: list[Episode]
    reference: list[Episode]

    def success(self, side: str) -> float:
        return self.share(side, _succeeded)

    def share(self, side: str, hit: Callable[[Episode], bool]) -> float:
        """The share of this side's samples ``hit`` holds for."""
        episodes = getattr(self, side)
        return sum(hit(e) for e in episodes) / len(episodes)

    def solved_steps(self, side: str) -> float | None:
        """Mean steps of this side's successful samples (None: none succeeded)."""
        steps = [e.steps for e in getattr(self, side) if e.success]
        return sum(steps) / len(steps) if steps else None


def decide(candidate: Evaluated, reference: Evaluated, *, baselines: dict[str, float], solver_steps: dict[str, int],
           gate: GateSettings) -> Decision:
    """The gate's decision on two evaluations of the same tasks (see the module doc). ``baselines``: each trivial
    policy's success rate on those tasks (``baselines()``); ``solver_steps``: the solver's steps per task id."""
    pairs = _pairs(candidate.episodes, reference.episodes, solver_steps)
    boot = {"confidence": gate.confidence, "resamples": gate.resamples, "seed": gate.seed}
    checks = [_success_gain(pairs, boot), *_over_baselines(pairs, baselines, gate.confidence),
              _invalid_rise(pairs, boot, gate.invalid_call_rate),
              _pooled_drop("recovery drop", [p for p in pairs if p.faulted], _succeeded, boot, gate.recovery_rate,
                           gate.min_faulted, "faulted tasks"),
              _pooled_drop("abstention drop", [p for p in pairs if p.direct], answered_directly, boot,
                           gate.abstention_rate, gate.min_direct, "tasks no offered tool fits"),
              _excess_steps(pairs, boot, gate.mean_steps),
              _perplexity_rise(candidate.general_losses, reference.general_losses, boot, gate.general_perplexity)]
    samples = max(len(p.candidate) for p in pairs)
    return Decision(passed=all(c.passed for c in checks), checks=checks, tasks=len(pairs), samples=samples,
                    confidence=gate.confidence, seed=gate.seed)


def spending(looks: Sequence[int], confidence: float) -> list[float]:
    """Each look's confidence when the gate looks after ``looks`` tasks (increasing; the last is all of them): the
    false-accept rate ``1 - confidence`` spent as ``alpha * t**2`` of the share ``t`` of tasks seen (a power spending
    function: little early, most at the end). An accept at any look needs every check to pass at that look's
    confidence, so by the union bound the false-accept rate over all looks is at most ``1 - confidence``."""
    alpha, total = 1 - confidence, looks[-1]
    spent = [alpha * (n / total) ** 2 for n in looks]
    return [1 - (spent[i] - (spent[i - 1] if i else 0.0)) for i in range(len(looks))]


def order_for_looks(tasks: Sequence[Task], first: int, min_faulted: int, min_direct: int = 0) -> list[Task]:
    """The gate's tasks in the order a sequential gate runs them: the first look's ``first`` tasks hold
    ``min_faulted`` faulted ones and ``min_direct`` that no offered tool fits (so the recovery and abstention checks
    can be judged there), every block the families in turn."""
    faulted = _by_family_in_turn([t for t in tasks if t.fault is not None])
    direct = _by_family_in_turn([t for t in tasks if t.direct])
    others = _by_family_in_turn([t for t in tasks if t.fault is None and not t.direct])
    head = faulted[:min_faulted] + direct[:min_direct] + others[:max(0, first - min_faulted - min_direct)]
    chosen = {t.id for t in head}
    return head + _by_family_in_turn([t for t in tasks if t.id not in chosen])


def _by_family_in_turn(tasks: Sequence[Task]) -> list[Task]:
    families: dict[str, list[Task]] = defaultdict(list)
    for t in tasks:
        families[t.family].append(t)
    queues = list(families.values())
    out = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


def look_points(gate: GateSettings) -> list[int]:
    """The task counts after which the gate decides: ``looks``, then all ``tasks``."""
    return [*gate.looks, gate.tasks]


def decide_at_look(candidate: Evaluated, reference: Evaluated, *, baselines: dict[str, float],
                   solver_steps: dict[str, int], gate: GateSettings, look: int, confidence: float,
                   history: list[dict[str, Any]]) -> tuple[Decision, bool]:
    """One look of a sequential gate, on the episodes so far: the decision at the look's ``confidence``, and whether
    it is settled (every check passed, or one failed beyond noise, or it is the last look)."""
    decision = decide(candidate, reference, baselines=baselines, solver_steps=solver_steps,
                      gate=gate.model_copy(update={"confidence": confidence}))
    last = look == len(gate.looks)
    settled = decision.passed or decision.settled_failure or last
    outcome = "passed" if decision.passed else "refused" if settled else "continue"
    looks = [*history, {"tasks": decision.tasks, "confidence": confidence, "outcome": outcome}]
    return replace(decision, looks=looks), settled


def decide_in_looks(candidate: list[Episode], reference: list[Episode], *, suite: Suite, tasks: Sequence[Task],
                    solver_steps: dict[str, int], gate: GateSettings) -> Decision:
    """The sequential gate on episodes already run on every task: each look decides on the tasks the gate would have
    run by then (``order_for_looks``), up to the first settled one. The same decisions ``training/gating.py`` makes
    while it runs the tasks, for tests and simulations."""
    points = look_points(gate)
    ordered = order_for_looks(tasks, points[0], gate.min_faulted, gate.min_direct)
    decision: Decision | None = None
    for look, (count, confidence) in enumerate(zip(points, spending(points, gate.confidence), strict=True)):
        seen = {t.id for t in ordered[:count]}
        decision, settled = decide_at_look(
            _Episodes([e for e in candidate if e.task_id in seen]),
            _Episodes([e for e in reference if e.task_id in seen]),
            baselines=baselines(suite, ordered[:count]), solver_steps=solver_steps, gate=gate, look=look,
            confidence=confidence, history=decision.looks if decision else [])
        if settled:
            break
    assert decision is not None
    return decision


@dataclass
class _Episodes:
    episodes: list[Episode]
    general_losses: list[Loss] = field(default_factory=list)


def _pairs(candidate: list[Episode], reference: list[Episode], solver_steps: dict[str, int]) -> list[_Pair]:
    by_task: dict[str, dict[str, list[Episode]]] = defaultdict(lambda: {"candidate": [], "reference": []})
    for side, episodes in (("candidate", candidate), ("reference", reference)):
        for e in episodes:
            by_task[e.task_id][side].append(e)
    unpaired = sorted(t for t, sides in by_task.items() if not sides["candidate"] or not sides["reference"])
    if unpaired or not by_task:
        raise ValueError(f"the gate compares episodes of the same tasks; {len(unpaired)} tasks have episodes on one "
                         f"side only (e.g. {unpaired[:3]})" if unpaired else "the gate needs episodes")
    missing = sorted(set(by_task) - set(solver_steps))
    if missing:
        raise ValueError(f"no solver steps for {len(missing)} gate tasks (e.g. {missing[:3]})")
    return [_Pair(task_id, sides["candidate"][0].faulted, sides["candidate"][0].direct, solver_steps[task_id],
                  sides["candidate"], sides["reference"]) for task_id, sides in sorted(by_task.items())]


def _gain(items: Sequence[_Pair]) -> float:
    """The mean paired success difference, candidate minus reference."""
    return mean([p.success("candidate") - p.success("reference") for p in items])


def _success_gain(pairs: list[_Pair], boot: dict[str, Any]) -> Check:
    estimate, lower, upper = paired_bootstrap(pairs, _gain, **boot)
    return Check("success gain", _rate(pairs, "reference"), _rate(pairs, "candidate"), estimate, lower, "lower",
                 0.0, ">", len(pairs), lower > 0, opposite=upper)


def _over_baselines(pairs: list[_Pair], baselines: dict[str, float], confidence: float) -> list[Check]:
    rate = _rate(pairs, "candidate")
    lower, upper = rate_bounds(rate * len(pairs), len(pairs), confidence)
    return [Check(f"over {name}", baseline, rate, rate, lower, "lower", baseline, ">", len(pairs), lower > baseline,
                  opposite=upper) for name, baseline in baselines.items()]


def _invalid_rise(pairs: list[_Pair], boot: dict[str, Any], margin: float) -> Check:
    def calls(items: Sequence[_Pair], side: str) -> int:
        return sum(e.tool_calls for p in items for e in getattr(p, side))

    def invalid_rate(items: Sequence[_Pair], side: str) -> float:
        made = calls(items, side)
        return sum(e.invalid_calls for p in items for e in getattr(p, side)) / made if made else 0.0

    estimate, lower, upper = paired_bootstrap(
        pairs, lambda items: invalid_rate(items, "candidate") - invalid_rate(items, "reference"), **boot)
    # A side that made (almost) no calls has a rate that says little: resamples without its calls count it 0.
    return Check("invalid-call rise", invalid_rate(pairs, "reference"), invalid_rate(pairs, "candidate"), estimate,
                 upper, "upper", margin, "≤", len(pairs), upper <= margin,
                 f"{calls(pairs, 'reference')} calls against {calls(pairs, 'candidate')}", opposite=lower)


def _succeeded(episode: Episode) -> bool:
    return episode.success


def _pooled_drop(name: str, pool: list[_Pair], hit: Callable[[Episode], bool], boot: dict[str, Any], margin: float,
                 minimum: int, what: str) -> Check:
    """Non-inferiority on a kind of task pooled: the lower bound of the paired difference in the share of samples
    ``hit`` holds for at least ``-margin``, judged only on at least ``minimum`` of them (none at all: skipped)."""
    if not pool:
        return Check(name, None, None, None, None, "lower", -margin, "≥", 0, True, f"no {what}")
    reference, candidate = _rate(pool, "reference", hit), _rate(pool, "candidate", hit)
    if len(pool) < minimum:
        return Check(name, reference, candidate, candidate - reference, None, "lower", -margin, "≥", len(pool),
                     False, f"{len(pool)} {what}, fewer than the {minimum} required")
    estimate, lower, upper = paired_bootstrap(
        pool, lambda items: _rate(items, "candidate", hit) - _rate(items, "reference", hit), **boot)
    return Check(name, reference, candidate, estimate, lower, "lower", -margin, "≥", len(pool), lower >= -margin,
                 opposite=upper)


def _excess_steps(pairs: list[_Pair], boot: dict[str, Any], margin: float) -> Check:
    both = [(p.solved_steps("candidate"), p.solved_steps("reference"), p.solver_steps) for p in pairs]
    both = [(c, r, s) for c, r, s in both if c is not None and r is not None]
    if not both:
        return Check("excess steps", None, None, None, None, "upper", margin, "≤", 0, True, "no task both solved")

    def excess(items: Sequence[tuple[float, float, int]], side: int) -> float:
        return mean([max(item[side] - item[2], 0.0) for item in items])

    estimate, lower, upper = paired_bootstrap(both, lambda items: excess(items, 0) - excess(items, 1), **boot)
    return Check("excess steps", excess(both, 1), excess(both, 0), estimate, upper, "upper", margin, "≤", len(both),
                 upper <= margin, opposite=lower)


def _perplexity_rise(candidate: list[Loss], reference: list[Loss], boot: dict[str, Any], margin: float) -> Check:
    if not reference:
        return Check("perplexity rise", None, None, None, None, "upper", margin, "≤", 0, True, "no general data")
    if len(candidate) != len(reference):
        return Check("perplexity rise", perplexity_of(reference), None, None, None, "upper", margin, "≤",
                     len(reference), False, "the candidate has no perplexity on the same general texts")
    texts = list(zip(candidate, reference, strict=True))

    def rise(items: Sequence[tuple[Loss, Loss]]) -> float:
        tokens = sum(r[1] for _, r in items)
        return math.exp((sum(c[0] for c, _ in items) - sum(r[0] for _, r in items)) / tokens) - 1

    estimate, lower, upper = paired_bootstrap(texts, rise, **boot)
    return Check("perplexity rise", perplexity_of(reference), perplexity_of(candidate), estimate, upper, "upper",
                 margin, "≤", len(texts), upper <= margin, opposite=lower)


def _rate(pairs: Sequence[_Pair], side: str, hit: Callable[[Episode], bool] = _succeeded) -> float:
    """The mean over ``pairs`` of this side's share of samples ``hit`` holds for."""
    return mean([p.share(side, hit) for p in pairs])


def baselines(suite: Suite, tasks: list[Task]) -> dict[str, float]:
    """Each trivial policy's success rate on ``tasks``: its first (and only) reply, judged by the verifier."""
    rates = {}
    for name in TRIVIAL_POLICIES:
        policy = POLICIES[name]
        solved = 0
        for task in tasks:
            messages = [{"role": "system", "content": suite.system_prompt}, {"role": "user", "content": task.prompt}]
            reply = policy({"messages": messages, "tools": []})
            solved += suite.verify(task, reply["content"], [*messages, reply])
        rates[name] = solved / len(tasks)
    return rates


async def solver_steps(suite: Suite, tasks: list[Task]) -> dict[str, int]:
    """The solver's model calls per task: its demonstration's assistant turns."""
    return {t.id: sum(m["role"] == "assistant" for m in await suite.solve(t)) for t in tasks}


def _format(check: Check, value: float | None, *, own: bool = False) -> str:
    """``own``: a side's own figure (a perplexity is no percentage; its rise is)."""
    if value is None:
        return "-"
    plain = check.name == "excess steps" or (own and check.name == "perplexity rise")
    return f"{value:.2f}" if plain else f"{value:.1%}"


def _bound_text(check: Check) -> str:
    if check.skipped:
        return check.note
    return (f"{check.side} bound {_format(check, check.bound)} "
            f"(must be {check.relation} {_format(check, check.threshold)})")


def decision_table(decision: Decision, reference: str, candidate: str) -> Table:
    """The decision, a check a row (each side's figure, the estimate, its bound and what it must be, the tasks or
    texts it rests on): what replay-train prints."""
    notes = [f"{c.name}: {c.note}" for c in decision.checks if c.note]
    table = Table(title=f"gate: {candidate} against {reference}, {decision.tasks} tasks × {decision.samples} "
                        f"sample(s), one-sided {decision.confidence:.0%} bounds: "
                        f"{'passed' if decision.passed else 'refused'}", caption="; ".join(notes) or None)
    table.add_column("check", no_wrap=True)
    for column in ("reference", "candidate", "bound", "must be", "n", ""):
        table.add_column(column, justify="right", no_wrap=True)
    for c in decision.checks:
        table.add_row(c.name, _format(c, c.reference, own=True), _format(c, c.candidate, own=True),
                      _format(c, c.bound), f"{c.relation} {_format(c, c.threshold)}",
                      str(c.n), "skip" if c.skipped and c.passed else "pass" if c.passed else "FAIL")
    return table
