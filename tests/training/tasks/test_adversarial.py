"""The committed adversarial policies (``training/tasks/adversarial.py``) against the verifier and the rewards:
each, run through the real agent loop and recorded into a real store, solves under 10% of every split and earns a
lower mean reward than the suite's solver, whose demonstrations go through the same path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.agent.limits import Limits
from gateway.agent.loop import AgentLoop, Profile, RunState
from gateway.agent.recording import StoreRecorder
from replay import feedback
from replay.rewards import load_view, score
from replay.settings import RewardSettings
from replay.store import TrajectoryStore
from tests.scripted import ScriptedBackend
from training.tasks import SPLITS, get_suite
from training.tasks.adversarial import POLICIES
from training.tasks.base import Suite, Task

MAX_STEPS = 6


async def _episode(suite: Suite, task: Task, store: TrajectoryStore, run_id: str, script: list[Any]
                   ) -> tuple[bool, float]:
    """One episode of ``script`` on ``task``, recorded and verified: (solved, total reward)."""
    profile = Profile(name="adversarial", model="scripted-model", system_prompt=suite.system_prompt,
                      tools=list(task.tools), limits=Limits(max_steps=MAX_STEPS))
    state = RunState(run_id=run_id, profile=profile.name, messages=[
        {"role": "system", "content": suite.system_prompt}, {"role": "user", "content": task.prompt}])
    recorder = StoreRecorder(store, profile=profile, backend="scripted")
    await recorder.start(state)
    loop = AgentLoop(profile=profile, backend=ScriptedBackend(script), toolbox=suite.toolbox(task),
                     recorder=recorder, state=state)
    await loop.run()
    solved = suite.verify(task, state.final, state.messages)
    await feedback.add(store, run_id, source="verifier", name="task_success", value=float(solved))
    view = await load_view(store, run_id, step_limits={profile.name: MAX_STEPS})
    assert view is not None
    total = score(view, RewardSettings()).total
    return solved, total if total is not None else 0.0


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[float, float]]]:
    """policy (and "solver") -> split -> (success rate, mean reward)."""
    root = tmp_path_factory.mktemp("adversarial")
    suite = get_suite("tools", data_dir=root / "tasks")

    async def run() -> dict[str, dict[str, tuple[float, float]]]:
        store = TrajectoryStore(str(root / "store.db"))
        await store.start()
        out: dict[str, dict[str, tuple[float, float]]] = {}
        try:
            for split in SPLITS:
                for task in suite.tasks(split):
                    demo = [m for m in await suite.solve(task) if m["role"] == "assistant"]
                    scripts = {"solver": demo, **{name: [policy] * (MAX_STEPS + 1)
                                                  for name, policy in POLICIES.items()}}
                    for name, script in scripts.items():
                        solved, reward = await _episode(suite, task, store, f"{name}-{task.id}", script)
                        out.setdefault(name, {}).setdefault(split, []).append((solved, reward))  # type: ignore[arg-type]
        finally:
            await store.close()
        return {name: {split: (sum(s for s, _ in rows) / len(rows), sum(r for _, r in rows) / len(rows))
                       for split, rows in by_split.items()} for name, by_split in out.items()}

    return asyncio.run(run())


def test_the_solver_solves_every_split(results: dict[str, dict[str, tuple[float, float]]]) -> None:
    assert all(success == 1.0 for success, _ in results["solver"].values()), results["solver"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_adversarial_policy_solves_under_10_percent_and_earns_less_than_the_solver(
        results: dict[str, dict[str, tuple[float, float]]], policy: str) -> None:
    for split in SPLITS:
        success, reward = results[policy][split]
        assert success < 0.10, (policy, split, success)
        assert reward < results["solver"][split][1], (policy, split, reward, results["solver"][split])


def test_the_policies_are_the_committed_set() -> None:
    assert set(POLICIES) == {"list_numbers", "always_refuse", "never_call", "pad_with_valid_calls", "repeat_a_call",
                             "ignore_the_result"}


def test_the_suite_is_what_the_module_names(tmp_path: Path) -> None:
    assert {t.split for t in get_suite("tools", data_dir=tmp_path).all_tasks()} == set(SPLITS)
