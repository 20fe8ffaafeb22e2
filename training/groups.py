"""Groups of sibling trajectories and their advantages: what RL (``training/rl.py``) trains on, as pure data.

A *group* is the sibling trajectories of one task: the ``n`` samples of one captured request, or the rollouts of
one task through the agent loop (``training/rollouts.py``). Each model call of a trajectory is one ``Sample``: the
exact prompt ids the model saw, the completion ids it wrote and their log-probabilities under the policy that wrote
them. Advantages: each trajectory's outcome reward against its group, RLOO (reward minus the mean of the others) or
GRPO (scaled by the group's std), plus ``process_coef`` times each step's own normalised process reward.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

EPS = 1e-4  # added to a group's reward std, as in the GRPO paper's reference implementation


@dataclass
class Sample:
    """One model call of a trajectory, as the policy that wrote it saw and scored it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # of completion_ids under the distribution the rollout sampled them from, as captured
    seq: int  # the model call's seq in its trajectory
    temperature: float  # the rollout's sampling temperature
    advantage: float = 0.0

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.logprobs)} log-probabilities for {len(self.completion_ids)} tokens")


@dataclass
class Trajectory:
    id: str
    reward: float
    samples: list[Sample]
    step_rewards: dict[int, float] = field(default_factory=dict)  # model call seq -> process reward
    success: float | None = None


@dataclass
class Group:
    key: str  # the group id (or the task id of several attempts at one task)
    trajectories: list[Trajectory]
    task_id: str | None = None

    @property
    def flat(self) -> bool:
        """No reward spread: every outcome advantage is 0."""
        return len({t.reward for t in self.trajectories}) <= 1

    @property
    def difficulty(self) -> float:
        """1 - the group's mean verified success; 0.5 where no trajectory's success is known."""
        known = [t.success for t in self.trajectories if t.success is not None]
        return 1.0 - sum(known) / len(known) if known else 0.5

    def samples(self) -> list[Sample]:
        return [s for t in self.trajectories for s in t.samples]


# -- advantages ------------------------------------------------------------------------------------------


def group_advantages(rewards: Sequence[float], algorithm: Literal["grpo", "rloo"]) -> list[float]:
    """Each reward against its group: GRPO normalises by the group's mean and sample std, RLOO subtracts the mean of
    the others. A group of one, or without spread, has advantages 0."""
    n = len(rewards)
    if len(set(rewards)) <= 1:  # exactly: a mean in floating point would leave crumbs of 1e-12
        return [0.0] * n
    total = math.fsum(rewards)
    if algorithm == "rloo":
        return [r - (total - r) / (n - 1) for r in rewards]
    if algorithm != "grpo":
        raise ValueError(f"unknown algorithm {algorithm!r}: grpo or rloo")
    mean = total / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + EPS) for r in rewards]


def process_advantages(group: Group) -> dict[tuple[str, int], float]:
    """Each scored step's process reward, normalised over all the group's scored steps: (trajectory, seq) -> value."""
    steps = [((t.id, seq), value) for t in group.trajectories for seq, value in t.step_rewards.items()]
    return dict(zip([key for key, _ in steps], group_advantages([v for _, v in steps], "grpo"), strict=True))


def assign_advantages(groups: Sequence[Group], algorithm: Literal["grpo", "rloo"], process_coef: float) -> None:
    """Set every sample's advantage: its trajectory's outcome advantage plus ``process_coef`` times its step's."""
    for group in groups:
        outcome = group_advantages([t.reward for t in group.trajectories], algorithm)
        process = process_advantages(group) if process_coef else {}
        for trajectory, advantage in zip(group.trajectories, outcome, strict=True):
            for sample in trajectory.samples:
                sample.advantage = advantage + process_coef * process.get((trajectory.id, sample.seq), 0.0)


def similar_batches(groups: Sequence[Group], size: int, seed: int) -> list[list[Group]]:
    """Groups cut into batches of ``size`` after sorting by difficulty (shuffled first, so ties fall randomly);
    the batches themselves in random order."""
    rng = random.Random(seed)
    order = list(groups)
    rng.shuffle(order)
    order.sort(key=lambda g: g.difficulty)
    batches = [order[i:i + size] for i in range(0, len(order), size)]
    rng.shuffle(batches)
    return batches
