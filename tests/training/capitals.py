"""A suite a tiny random model can learn in seconds: every question's answer is "Paris", no tool needed. Neither
trivial policy solves any of it (a refusal or "42" is wrong), so a trained adapter can pass the real gate."""

from __future__ import annotations

import random
from typing import Any

from tools.context import ToolContext
from tools.registry import ToolRegistry
from training.tasks import SPLITS, Suite, Task
from training.tasks.base import Demonstration, Plan

SIZES = {"train": 48, "validation": 8, "test": 16}
QUESTIONS = ("Question {n}: which city is the capital of France?", "Tell me, for case {n}, France's capital.",
             "Item {n}. Name the French capital city.")


class CapitalsSuite(Suite):
    name = "capitals"
    system_prompt = "Answer with the city."
    version = "1"

    def __init__(self, data_dir: Any = None) -> None:
        self._tasks = {split: self._draw(split, count, random.Random(split), split) for split, count in SIZES.items()}

    def _draw(self, split: str, count: int, rng: random.Random, label: str) -> list[Task]:
        numbers = rng.sample(range(1000 * SPLITS.index(split), 1000 * (SPLITS.index(split) + 1)), count)
        return [Task(id=f"capitals/{label}/{i:03d}", suite=self.name, family="capital", split=split,
                     prompt=QUESTIONS[i % len(QUESTIONS)].format(n=n), tools=(), expected="Paris")
                for i, n in enumerate(numbers)]

    def tasks(self, split: str) -> list[Task]:
        self.check_split(split)
        return list(self._tasks[split])

    def draw(self, split: str, count: int, *, seed: int, min_faulted: int = 0, min_direct: int = 0) -> list[Task]:
        return self._draw(split, count, random.Random(f"{split}:{seed}"), f"{split}-draw-{seed}")

    def registry(self) -> ToolRegistry:
        return ToolRegistry()

    def context(self) -> ToolContext:
        return ToolContext()

    def plan(self, task: Task) -> Plan:
        return _paris


async def _paris(demo: Demonstration) -> None:
    demo.answer("Paris")
