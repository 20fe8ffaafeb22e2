"""The gate's reference report: evaluated once, read back while nothing it depends on changed."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from tests.extras import skip_without

skip_without("train")

from tests.models import random_lora
from training.evaluate import Evaluator
from training.references import ReferenceCache, reference_key, reference_report
from training.settings import TrainingSettings
from training.tasks import get_suite
from training.tasks.tools_suite import ToolsSuite

pytestmark = pytest.mark.integration


def test_the_reference_is_evaluated_once_and_again_when_what_it_depends_on_changes(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Unconstrained: a tool call's grammar that takes over 2 s to build (16 at once on a busy machine) fails its
    # episode, and the cached report must equal a second evaluation episode for episode.
    settings = TrainingSettings(model_path=str(tiny_model_dir), tasks_dir=str(tmp_path / "tasks"), eval_max_tokens=4,
                                eval_concurrency=16, constrain_tool_calls=False)
    cache = ReferenceCache(tmp_path / "references")
    suite = get_suite("tools", data_dir=settings.tasks_dir)
    tasks = suite.draw("test", 100, seed=0, min_faulted=20)
    adapter = random_lora(tiny_model_dir, tmp_path / "adapter", seed=1)

    async def run() -> list[tuple[str, bool, int]]:
        outcomes = []
        async with Evaluator(settings) as evaluator:
            evaluated = 0
            real = evaluator.evaluate_tasks

            async def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                nonlocal evaluated
                evaluated += 1
                return await real(*args, **kwargs)

            evaluator.evaluate_tasks = counted  # type: ignore[method-assign]
            for model, label in ((None, "base"), (None, "base"), (adapter, "tools@1"), (adapter, "tools@1")):
                report, hit = await reference_report(evaluator, cache, suite, tasks, model, settings, label=label)
                assert report.model == label and len(report.episodes) == len(tasks)
                outcomes.append((label, hit, evaluated))
            first = (await reference_report(evaluator, cache, suite, tasks, None, settings, label="base"))[0]
            again = (await real(suite, tasks, None, split="gate", samples=settings.gate.samples,  # what the cached
                                temperature=settings.gate.temperature)).episodes  # report stands for
            assert [dataclasses.replace(e, run_id="") for e in first.episodes] == [
                dataclasses.replace(e, run_id="") for e in again]
            monkeypatch.setattr(ToolsSuite, "version", "changed")
            outcomes.append(("base", (await reference_report(evaluator, cache, suite, tasks, None, settings,
                                                             label="base"))[1], evaluated))
        return outcomes

    assert asyncio.run(run()) == [("base", False, 1), ("base", True, 1), ("tools@1", False, 2), ("tools@1", True, 2),
                                  ("base", False, 3)]
    assert len(list((tmp_path / "references").glob("*.json"))) == 3


def test_the_key_follows_the_weights_the_tasks_and_the_decoding(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = TrainingSettings(model_path=str(tiny_model_dir), tasks_dir=str(tmp_path / "tasks"))
    suite = get_suite("tools", data_dir=settings.tasks_dir)
    tasks = suite.draw("test", 100, seed=0)
    adapter = random_lora(tiny_model_dir, tmp_path / "adapter", seed=1)
    key = reference_key(suite, tasks, adapter, settings)
    fresh = get_suite("tools", data_dir=settings.tasks_dir)
    assert key == reference_key(fresh, fresh.draw("test", 100, seed=0), adapter, settings)

    def gate(**changes: object) -> TrainingSettings:
        return settings.model_copy(update={"gate": settings.gate.model_copy(update=changes)})

    others = {
        reference_key(suite, tasks, None, settings),
        reference_key(suite, suite.draw("test", 100, seed=1), adapter, settings),
        reference_key(suite, tasks[:99], adapter, settings),
        reference_key(suite, tasks, adapter, settings.model_copy(update={"eval_max_tokens": 7})),
        reference_key(suite, tasks, adapter, settings.model_copy(update={"seed": 5})),
        reference_key(suite, tasks, adapter, gate(samples=3)),
        reference_key(suite, tasks, random_lora(tiny_model_dir, tmp_path / "other", seed=2), settings),
    }
    assert key not in others and len(others) == 7
    # The sampling temperature matters only when there are samples to draw.
    assert reference_key(suite, tasks, adapter, gate(temperature=1.0)) == key
    assert reference_key(suite, tasks, adapter, gate(samples=3, temperature=1.0)) != \
        reference_key(suite, tasks, adapter, gate(samples=3))
