"""Where RL groups come from: trajectories already in the store, and fresh rollouts through the agent loop.

``groups_from_store`` reads trajectories back as ``training.rl.Group``s: siblings share a group id (the ``n``
samples of one request), else a task id (several attempts at one task). Each model call becomes a sample from
its captured prompt ids, completion ids and log-probabilities; a call recorded without them (another backend, an
import) cannot be trained on exactly and is left out, as is a trajectory of another base model; a trajectory
without siblings gives no comparison. All of these are counted (``GroupStats``). Rewards are scored afresh by the
reward engine (``[rewards]``); a trajectory's outcome reward is its verified task success where the verifier (or a
user) spoke, else the total (``[training.rl] outcome``); each step's process reward is the weighted sum of the
signals that credit steps.

``Rollouts`` makes new groups: each step it picks tasks of similar difficulty from the suite's train split
(``TaskPicker``), injects a tool fault into some of them (``fault_rate``), runs ``group_size`` episodes of each
through the agent loop with the current policy, sampled at ``temperature``, records them in the store (source
``rollout``, one group id per task), has the verifier and the reward engine score them, and reads them back.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from gateway.backends.local.sampling import GREEDY_BELOW
from replay.model import ModelCall
from replay.records import WriteOp, new_id
from replay.rewards import IN_FLIGHT, result_statements, score, signal_weights, step_limits, view_of
from replay.store import TrajectoryStore
from replay.vocabulary import CALL_OK, ROLLOUT
from training.capture import label_episodes, store_recorder
from training.evaluate import Evaluator
from training.groups import Group, Sample, Trajectory
from training.metrics import Episode
from training.settings import HarnessSettings
from training.tasks import Fault, Task, get_suite
from training.tasks.base import FAULT_KINDS

log = structlog.get_logger()


@dataclass
class GroupStats:
    trajectories: int = 0  # read
    groups: int = 0  # made (two or more trajectories each)
    without_siblings: int = 0  # trajectories alone in their group (or in none)
    without_logprobs: int = 0  # trajectories with no model call captured with token ids and log-probabilities
    other_model: int = 0  # trajectories of another base model
    unscored: int = 0  # in flight, or no reward signal known

    def describe(self) -> str:
        return (f"{self.groups} groups from {self.trajectories} trajectories ({self.without_siblings} without "
                f"siblings, {self.without_logprobs} without captured log-probabilities, {self.other_model} of "
                f"another model, {self.unscored} unscored)")


async def groups_from_store(store: TrajectoryStore, ids: list[str], rewards: Mapping[str, float], *, base_model: str,
                            step_limits: Mapping[str, int] | None = None, save_rewards: bool = False,
                            outcome: Literal["success", "total"]) -> tuple[list[Group], GroupStats]:
    """The groups the trajectories ``ids`` form (see the module doc); ``save_rewards`` also stores their scores.
    ``outcome``: each trajectory's reward is its verified success where known (``success``; else the total), or the
    reward engine's total (``total``)."""
    stats = GroupStats()
    members: dict[str, list[Trajectory]] = {}
    task_of: dict[str, str | None] = {}
    statements = []
    for tid in ids:
        stats.trajectories += 1
        stored = await store.get_trajectory(tid, all_tenants=True)
        view = None if stored is None else view_of(stored, step_limits=step_limits)
        if stored is None or view is None or view.status in IN_FLIGHT:
            stats.unscored += 1
            continue
        result = score(view, rewards)
        if save_rewards:
            statements += result_statements(result)
        if result.total is None:
            stats.unscored += 1
            continue
        if stored.base_model not in (None, base_model):
            stats.other_model += 1
            continue
        samples = []
        for c in stored.steps:
            sampled = _sampled(c) if c.status == CALL_OK and c.prompt_token_ids and c.completion_token_ids else None
            if sampled is not None:
                samples.append(Sample(c.prompt_token_ids, c.completion_token_ids[0], sampled[0], c.seq,
                                      temperature=sampled[1]))
        if not samples:
            stats.without_logprobs += 1
            continue
        step_rewards: dict[int, float] = {}
        for signal, per_step in result.per_step.items():
            for seq, value in per_step.items():
                step_rewards[seq] = step_rewards.get(seq, 0.0) + result.weights.get(signal, 0.0) * value
        key = stored.group_id or stored.task_id
        if key is None:
            stats.without_siblings += 1
            continue
        success = result.signals.get("task_success")
        reward = success if outcome == "success" and success is not None else result.total
        members.setdefault(key, []).append(Trajectory(id=tid, reward=reward, samples=samples,
                                                      step_rewards=step_rewards, success=success))
        task_of[key] = stored.task_id
    if statements:
        await store.write(WriteOp(statements=statements))
    groups = []
    for key, trajectories in members.items():
        if len(trajectories) < 2:
            stats.without_siblings += len(trajectories)
        else:
            groups.append(Group(key=key, trajectories=trajectories, task_id=task_of[key]))
    stats.groups = len(groups)
    return groups, stats


def _sampled(call: ModelCall) -> tuple[list[float], float] | None:
    """The first choice's log-probabilities under the distribution it was sampled from, and the temperature; None
    when they were not captured, or the call was greedy (no distribution to weigh an update against)."""
    temperature = call.request.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature < GREEDY_BELOW:
        return None
    if call.completion_sampled_logprobs:
        return call.completion_sampled_logprobs[0], temperature
    # Captured before both were kept: the model's own log-probabilities are the sampled ones only at temperature 1.
    if call.completion_logprobs and temperature == 1.0:
        return call.completion_logprobs[0], temperature
    return None


class TaskPicker:
    """Each step's tasks: a random pivot and the tasks whose estimated difficulty is nearest its own.

    A task's difficulty is its smoothed failure rate over the rollouts seen so far, ``1 - (successes + 1) /
    (attempts + 2)``: 0.5 before any, so the first steps pick at random.
    """

    def __init__(self, tasks: list[Task], seed: int) -> None:
        self.tasks = list(tasks)
        self.rng = random.Random(seed)
        self.seen = {t.id: [0, 0] for t in tasks}  # successes, attempts

    def difficulty(self, task: Task) -> float:
        successes, attempts = self.seen[task.id]
        return 1.0 - (successes + 1) / (attempts + 2)

    def pick(self, count: int) -> list[Task]:
        pivot = self.difficulty(self.rng.choice(self.tasks))
        order = list(self.tasks)
        self.rng.shuffle(order)  # ties fall at random
        order.sort(key=lambda t: abs(self.difficulty(t) - pivot))
        return order[:count]

    def observe(self, episodes: list[Episode]) -> None:
        for e in episodes:
            if e.task_id in self.seen:
                self.seen[e.task_id][0] += int(e.success)
                self.seen[e.task_id][1] += 1


def with_fault(task: Task, rng: random.Random, rate: float) -> Task:
    """``task``, or with probability ``rate`` the task with its first call to one of its tools failing (a timeout, an
    empty result or an error). Tasks that already carry a fault keep it."""
    if task.fault is not None or not task.tools or rng.random() >= rate:
        return task
    return dataclasses.replace(task, fault=Fault(tool=rng.choice(task.tools), kind=rng.choice(FAULT_KINDS)))


class Rollouts:
    """Online groups from the suite's train split (see the module doc); call ``collect`` once per step."""

    def __init__(self, settings: HarnessSettings, evaluator: Evaluator, store: TrajectoryStore, *, run: str) -> None:
        self.settings = settings
        self.rl = settings.training.rl
        self.evaluator = evaluator
        self.store = store
        self.run = run
        self.suite = get_suite(settings.training.suite, data_dir=settings.training.tasks_dir)
        self.tasks = self.suite.tasks("train")
        self.picker = TaskPicker(self.tasks, settings.training.seed)
        self.rng = random.Random(settings.training.seed + 1)
        self.weights = signal_weights(settings.rewards)
        self.step_limits = step_limits(settings.profiles)
        self.stats = GroupStats()
        self.episodes = 0
        self.seconds = 0.0

    async def collect(self, step: int, policy: Path | None) -> list[Group]:
        started = time.perf_counter()
        chosen = [with_fault(t, self.rng, self.rl.fault_rate) for t in self.picker.pick(self.rl.tasks_per_step)]
        group_ids = {t.id: new_id() for t in chosen}
        episodes = await self.evaluator.episodes(
            self.suite, [t for t in chosen for _ in range(self.rl.group_size)], policy,
            recorder_for=store_recorder(self.store, self.settings.training.base_model, ROLLOUT),
            temperature=self.rl.temperature, progress=f"rollouts, step {step}")
        if policy is not None:
            await self.evaluator.release(policy)  # the trainer rewrites this folder before the next step
        await label_episodes(self.store, self.suite.name, chosen, "train", episodes, groups=group_ids,
                             metadata={"rl_run": self.run, "rl_step": step})
        self.picker.observe(episodes)
        groups, stats = await groups_from_store(
            self.store, [e.run_id for e in episodes], self.weights, base_model=self.settings.training.base_model,
            step_limits=self.step_limits, save_rewards=True, outcome=self.rl.outcome)
        for name, value in dataclasses.asdict(stats).items():
            setattr(self.stats, name, getattr(self.stats, name) + value)
        self.episodes += len(episodes)
        self.seconds += time.perf_counter() - started
        log.info("rl.rollouts", step=step, episodes=len(episodes), groups=len(groups),
                 succeeded=sum(e.success for e in episodes), seconds=round(time.perf_counter() - started, 1))
        return groups
