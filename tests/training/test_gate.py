"""The gate's rule on episodes run through the real agent loop: the suite's solver, the adversarial policies and
a noisy model as scripted backends on the gate's 100 tasks (drawn as replay-train draws them), each judged by the
suite's verifier; then each guard on its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.scripted import ScriptedBackend
from training.episodes import EPISODE_LIMITS, run_episode
from training.gate import Decision, baselines, decide, decision_table, solver_steps
from training.metrics import Episode, Loss
from training.settings import GateSettings
from training.tasks import Task, leak_filter
from training.tasks.adversarial import POLICIES
from training.tasks.base import Direct
from training.tasks.tools_suite import ToolsSuite

GATE = GateSettings()
Script = Callable[[Task], list[Any]]


@dataclass
class Side:
    episodes: list[Episode]
    general_losses: list[Loss] = field(default_factory=list)


@dataclass
class Bench:
    suite: ToolsSuite
    tasks: list[Task]
    demos: dict[str, list[dict[str, Any]]]
    baselines: dict[str, float]
    solver_steps: dict[str, int]

    def run(self, script: Script) -> list[Episode]:
        async def all_tasks() -> list[Episode]:
            return [await run_episode(self.suite, task, ScriptedBackend(script(task)), model="scripted-model",
                                      max_tokens=64) for task in self.tasks]
        return asyncio.run(all_tasks())

    def solver(self, task: Task) -> list[Any]:
        return [m for m in self.demos[task.id] if m["role"] == "assistant"]

    def decide(self, candidate: list[Episode], reference: list[Episode], gate: GateSettings = GATE, *,
               general: tuple[list[Loss], list[Loss]] = ([], [])) -> Decision:
        """``general``: the candidate's and the reference's losses on the held-out general texts."""
        return decide(Side(candidate, general[0]), Side(reference, general[1]), baselines=self.baselines,
                      solver_steps=self.solver_steps, gate=gate)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Bench:
    suite = ToolsSuite(tmp_path_factory.mktemp("tasks"))
    tasks = suite.draw("test", GATE.tasks, seed=GATE.seed, min_faulted=GATE.min_faulted, min_direct=GATE.min_direct)

    async def solve() -> dict[str, list[dict[str, Any]]]:
        return {t.id: await suite.solve(t) for t in tasks}

    return Bench(suite, tasks, asyncio.run(solve()), baselines(suite, tasks), asyncio.run(solver_steps(suite, tasks)))


@pytest.fixture(scope="module")
def episodes(bench: Bench) -> dict[str, list[Episode]]:
    """solver, each adversarial policy, and noise (invalid calls and a wrong answer) on every gate task."""
    def noise(task: Task) -> list[Any]:
        wrong = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function",
                 "function": {"name": task.tools[0], "arguments": json.dumps({"no such argument": 1})}}]}
        return [wrong, "Blue seven, probably 3.5 or 12."]

    scripts: dict[str, Script] = {"solver": bench.solver, "noise": noise, **{
        name: (lambda task, p=policy: [p] * (EPISODE_LIMITS.max_steps + 1)) for name, policy in POLICIES.items()}}
    return {name: bench.run(script) for name, script in scripts.items()}


def checks(decision: Decision) -> dict[str, bool]:
    return {c.name: c.passed for c in decision.checks}


def test_the_gate_tasks_are_drawn_from_the_test_templates_with_enough_faults(bench: Bench) -> None:
    tasks = bench.tasks
    assert len(tasks) == 100 and len({t.prompt for t in tasks}) == 100
    assert sum(t.fault is not None for t in tasks) >= GATE.min_faulted
    assert sum(isinstance(t.expected, Direct) for t in tasks) >= GATE.min_direct == 15
    assert all(t.split == "test" for t in tasks)
    seen = {t.prompt for split in ("train", "validation") for t in bench.suite.tasks(split)}
    assert not seen & {t.prompt for t in tasks}
    again = ToolsSuite(bench.suite.data_dir).draw("test", 100, seed=GATE.seed, min_faulted=GATE.min_faulted,
                                                  min_direct=GATE.min_direct)
    assert again == tasks  # the fixed seed: the same tasks at every run
    assert ToolsSuite(bench.suite.data_dir).draw("test", 100, seed=1, min_faulted=20) != tasks
    assert {t.family for t in tasks} == {t.family for t in bench.suite.tasks("test")}
    # replay-train's leak filter drops a training row that holds a gate prompt.
    held_out = leak_filter(bench.suite, tasks)
    assert all(held_out(f"user: {t.prompt}") for t in tasks)
    assert not any(held_out(t.prompt) for t in bench.suite.tasks("train"))
    # Decline tasks stay under a tenth, so refusing everything stays a weak baseline.
    assert bench.baselines["always_refuse"] < 0.1 and bench.baselines["never_call"] == 0.0


def test_the_solver_passes_against_a_model_that_solves_nothing(bench: Bench, episodes: dict) -> None:
    assert all(e.success for e in episodes["solver"])
    decision = bench.decide(episodes["solver"], episodes["never_call"])
    assert decision.passed, decision.failures()
    gain = decision.checks[0]
    assert gain.name == "success gain" and gain.estimate == 1.0 and gain.bound == 1.0
    stored = decision.as_dict()
    assert stored["tasks"] == 100 and stored["samples"] == 1 and stored["seed"] == GATE.seed
    assert {c["name"] for c in stored["checks"]} == {
        "success gain", "over always_refuse", "over never_call", "invalid-call rise",
        "recovery drop", "abstention drop", "excess steps", "perplexity rise"}
    assert "perplexity rise" in [c.name for c in decision.checks if c.skipped]  # no general data here


@pytest.mark.parametrize("policy", [*sorted(POLICIES), "noise"])
def test_adversarial_policies_and_noise_fail_however_weak_the_reference(bench: Bench, episodes: dict,
                                                                        policy: str) -> None:
    for reference in ("never_call", "noise"):
        decision = bench.decide(episodes[policy], episodes[reference])
        assert not decision.passed, (policy, reference)


def test_refusing_everything_beats_a_silent_base_but_not_the_trivial_policy(bench: Bench, episodes: dict) -> None:
    decision = bench.decide(episodes["always_refuse"], episodes["never_call"])
    assert checks(decision)["success gain"]  # 7 more tasks of 100 than a model that solves none
    assert not checks(decision)["over always_refuse"]


def _mix(bench: Bench, episodes: dict, solved: Callable[[int, Task], bool], other: str = "never_call"
         ) -> list[Episode]:
    return [episodes["solver"][i] if solved(i, t) else episodes[other][i] for i, t in enumerate(bench.tasks)]


def _solving_30(bench: Bench, episodes: dict) -> list[Episode]:
    return _mix(bench, episodes, lambda i, _: i < 30)


def test_an_improvement_within_noise_does_not_pass_and_a_clear_one_does(bench: Bench, episodes: dict) -> None:
    reference = _mix(bench, episodes, lambda i, _: i < 30)
    within = bench.decide(_mix(bench, episodes, lambda i, _: i < 32), reference)  # 2 more of 100
    assert not within.passed and [c.name for c in within.failures()] == ["success gain"]
    # Not better at all, or only in exchange for other tasks, does not pass either.
    assert not bench.decide(reference, reference).passed
    swapped = bench.decide(_mix(bench, episodes, lambda i, _: 5 <= i < 40), reference)  # 10 more, 5 fewer
    assert not swapped.passed
    clear = bench.decide(_mix(bench, episodes, lambda i, _: i < 60), reference)
    assert clear.passed, clear.failures()
    assert clear.checks[0].estimate == pytest.approx(0.30) and clear.checks[0].bound > 0.2


def test_calling_a_tool_where_none_fits_fails_however_much_else_improves(bench: Bench, episodes: dict) -> None:
    def direct(task: Task) -> bool:
        return isinstance(task.expected, Direct)

    reference = _mix(bench, episodes, lambda i, t: i < 30 or direct(t))
    calling = _mix(bench, episodes, lambda i, t: not direct(t), other="pad_with_valid_calls")
    decision = bench.decide(calling, reference)
    assert checks(decision)["success gain"] and not decision.passed
    guard = next(c for c in decision.checks if c.name == "abstention drop")
    assert not guard.passed and guard.n == 15 and guard.reference == 1.0 and guard.candidate == 0.0
    assert guard.settled_failure
    # Answering without a call, even wrongly (a guess), keeps the rate: only success judges the answer.
    guessing = _mix(bench, episodes, lambda i, t: not direct(t), other="never_call")
    assert checks(bench.decide(guessing, reference))["abstention drop"]
    # Judged only on enough such tasks.
    few = next(c for c in bench.decide(guessing, reference, GateSettings(min_direct=50)).checks
               if c.name == "abstention drop")
    assert not few.passed and "fewer than the 50 required" in few.note


def test_more_invalid_calls_fail_even_with_more_successes(bench: Bench, episodes: dict) -> None:
    def sloppy(task: Task) -> list[Any]:  # an invalid call before each demonstration
        wrong = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_x", "type": "function",
                 "function": {"name": "no_such_tool", "arguments": "{}"}}]}
        return [wrong, *bench.solver(task)]

    candidate = bench.run(sloppy)
    # Every task but those no offered tool fits, where any call, an invalid one too, fails.
    assert sum(e.success for e in candidate) == sum(not isinstance(t.expected, Direct) for t in bench.tasks)
    decision = bench.decide(candidate, _solving_30(bench, episodes))
    assert checks(decision) == {**checks(decision), "success gain": True, "invalid-call rise": False}
    assert not decision.passed
    invalid = next(c for c in decision.checks if c.name == "invalid-call rise")
    made = sum(e.tool_calls for e in candidate)
    assert invalid.note == f"{sum(e.tool_calls for e in _solving_30(bench, episodes))} calls against {made}"



def test_recovery_is_judged_pooled_over_the_faulted_tasks(bench: Bench, episodes: dict) -> None:
    # The reference solves only the faulted tasks; the candidate solves every other one: more successes, no
    # recovery left.
    reference = _mix(bench, episodes, lambda _, t: t.fault is not None)
    candidate = _mix(bench, episodes, lambda _, t: t.fault is None)
    decision = bench.decide(candidate, reference)
    recovery = next(c for c in decision.checks if c.name == "recovery drop")
    assert checks(decision)["success gain"] and not recovery.passed
    assert recovery.n == sum(t.fault is not None for t in bench.tasks) and recovery.estimate == -1.0
    # Too few faulted tasks cannot judge recovery: the check fails and says so.
    few = bench.decide(candidate, reference, GateSettings(min_faulted=50))
    assert "fewer than the 50 required" in next(c for c in few.checks if c.name == "recovery drop").note


def test_steps_are_compared_on_tasks_both_solved_against_the_solvers(bench: Bench, episodes: dict) -> None:
    def padded(task: Task) -> list[Any]:  # two needless valid calls before each demonstration
        return [POLICIES["repeat_a_call"], POLICIES["repeat_a_call"], *bench.solver(task)]

    reference = _mix(bench, episodes, lambda i, _: i < 50)
    slow = bench.decide(bench.run(padded), reference)
    steps = next(c for c in slow.checks if c.name == "excess steps")
    assert not steps.passed and steps.n >= 40 and steps.estimate == pytest.approx(2.0, abs=0.2)
    assert steps.reference == 0.0  # the solver's own steps are no excess
    # A candidate that solves with the solver's steps passes, though a reference that solves nothing (1 step a
    # task) took fewer.
    assert checks(bench.decide(episodes["solver"], episodes["never_call"]))["excess steps"]


def test_general_perplexity_may_rise_by_at_most_its_margin(bench: Bench, episodes: dict) -> None:
    reference = _mix(bench, episodes, lambda i, _: i < 30)
    candidate = episodes["solver"]
    base = [(10.0 + i % 7, 20 + i % 5) for i in range(40)]
    rise = {"perplexity rise": False}
    worse = bench.decide(candidate, reference, general=([(n + t * 0.2, t) for n, t in base], base))
    assert checks(worse) == {**checks(worse), **rise}  # exp(0.2) - 1 = 22%
    slight = bench.decide(candidate, reference, general=([(n + t * 0.01, t) for n, t in base], base))
    assert slight.passed, slight.failures()  # exp(0.01) - 1 = 1%
    missing = bench.decide(candidate, reference, general=([], base))
    assert not checks(missing)["perplexity rise"]


def test_paired_evaluation_needs_the_same_tasks_on_both_sides(bench: Bench, episodes: dict) -> None:
    with pytest.raises(ValueError, match="one side only"):
        bench.decide(episodes["solver"][:50], episodes["never_call"])


def test_several_samples_a_task_count_as_a_share(bench: Bench, episodes: dict) -> None:
    # Three samples a task: the candidate solves two of three where the reference solved one of three.
    reference = [e for i in range(3) for e in _mix(bench, episodes, lambda j, _, i=i: i == 0 and j < 40)]
    candidate = [e for i in range(3) for e in _mix(bench, episodes, lambda j, _, i=i: i < 2 and j < 40)]
    decision = bench.decide(candidate, reference, GateSettings(tasks=40, samples=3))
    assert decision.samples == 3 and decision.tasks == 100
    assert decision.checks[0].estimate == pytest.approx(0.4 / 3)


def test_the_decision_prints_as_a_table(bench: Bench, episodes: dict) -> None:
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(decision_table(bench.decide(episodes["solver"], episodes["never_call"]), "base", "candidate"))
    text = console.export_text()
    assert "gate: candidate against base, 100 tasks × 1 sample(s), one-sided 95%" in text and "passed" in text
    assert "over always_refuse" in text and "no general data" in text


def test_the_settings_refuse_a_gate_too_small_to_tell_noise_from_gain() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="at least 100 tasks"):
        GateSettings(tasks=63)
    with pytest.raises(ValidationError):
        GateSettings(tasks=40, samples=2)
    assert GateSettings(tasks=40, samples=3).tasks == 40



# -- a sequential gate --------------------------------------------------------------------------------------------

SEQUENTIAL = GateSettings(looks=[40, 70])


def _sequential(bench: Bench, candidate: list[Episode], reference: list[Episode]) -> Decision:
    """The gate's looks as replay-train takes them (training/gating.py), on episodes already run."""
    from training.gate import decide_in_looks

    return decide_in_looks(candidate, reference, suite=bench.suite, tasks=bench.tasks,
                           solver_steps=bench.solver_steps, gate=SEQUENTIAL)


def test_spending_gives_out_the_whole_false_accept_rate_little_at_first() -> None:
    from training.gate import spending

    assert spending([100], 0.95) == [0.95]
    confidences = spending([40, 70, 100], 0.95)
    alphas = [1 - c for c in confidences]
    assert sum(alphas) == pytest.approx(0.05) and alphas[0] < alphas[1] < alphas[2]
    assert alphas[0] == pytest.approx(0.05 * 0.16)


def test_the_first_look_holds_the_faulted_and_direct_tasks_and_every_family(bench: Bench) -> None:
    from training.gate import order_for_looks

    ordered = order_for_looks(bench.tasks, 60, 20, 15)
    assert sorted(t.id for t in ordered) == sorted(t.id for t in bench.tasks)
    assert sum(t.fault is not None for t in ordered[:60]) == 20
    assert sum(isinstance(t.expected, Direct) for t in ordered[:60]) == 15
    assert {t.family for t in ordered[:60]} == {t.family for t in bench.tasks}


def test_a_clear_gain_is_accepted_at_the_first_look_and_noise_refused_there(bench: Bench, episodes: dict) -> None:
    accepted = _sequential(bench, episodes["solver"], episodes["never_call"])
    assert accepted.passed and accepted.tasks == 40
    assert [look["outcome"] for look in accepted.looks] == ["passed"]
    refused = _sequential(bench, episodes["noise"], episodes["never_call"])
    assert not refused.passed and refused.tasks == 40 and refused.settled_failure
    assert refused.as_dict()["looks"] == [{"tasks": 40, "confidence": pytest.approx(0.992), "outcome": "refused"}]


def test_what_the_fixed_rule_refuses_the_sequential_gate_refuses_after_every_look(bench: Bench,
                                                                                  episodes: dict) -> None:
    # Solving 30 of 100 tasks more than the reference passes the fixed rule; 5 more do not (no better than refusing).
    small = _mix(bench, episodes, lambda i, t: i % 20 == 0)
    assert not bench.decide(small, episodes["never_call"]).passed
    decision = _sequential(bench, small, episodes["never_call"])
    assert not decision.passed
    assert [look["tasks"] for look in decision.looks][-1] in (40, 70, 100)


def test_the_looks_must_rise_below_the_tasks_and_start_with_enough_of_them() -> None:
    from pydantic import ValidationError

    for looks in ([70, 40], [40, 100], [10]):
        with pytest.raises(ValidationError):
            GateSettings(looks=looks)
