"""The evaluator and the general check give their weights back between uses (training runs in between) and come
back to the same results."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from tests.extras import skip_without

skip_without("train")

from tests.models import random_lora
from training.evaluate import Evaluator
from training.general import GeneralCheck
from training.settings import TrainingSettings
from training.tasks import get_suite

pytestmark = pytest.mark.integration


def _plain(episodes: list) -> list:
    return [dataclasses.replace(e, run_id="") for e in episodes]


def test_a_paused_evaluator_starts_again_on_use_with_the_same_results(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = TrainingSettings(model_path=str(tiny_model_dir), tasks_dir=str(tmp_path / "tasks"), eval_max_tokens=4,
                                eval_concurrency=4)
    suite = get_suite("tools", data_dir=settings.tasks_dir)
    tasks = suite.tasks("validation")[:6]
    adapter = random_lora(tiny_model_dir, tmp_path / "adapter", seed=3)

    async def run() -> tuple[list, list, list]:
        async with Evaluator(settings) as evaluator:
            assert evaluator.backend is None  # nothing loaded before the first evaluation
            first = await evaluator.episodes(suite, tasks, adapter)
            engine = evaluator.backend
            assert engine is not None and await engine.loaded_adapters()
            await evaluator.pause()
            assert evaluator.backend is None
            again = await evaluator.episodes(suite, tasks, adapter)  # a new backend, the adapter loaded into it
            assert evaluator.backend is not None and evaluator.backend is not engine
            base = await evaluator.episodes(suite, tasks)
        assert evaluator.backend is None  # closed on leaving
        return first, again, base

    first, again, base = asyncio.run(run())
    assert _plain(first) == _plain(again)
    assert len(base) == len(tasks)


def test_the_general_check_measures_the_same_after_releasing_its_weights(tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    general = tmp_path / "general.jsonl"
    general.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell me about the number {i}."},
        {"role": "assistant", "content": f"The number {i} comes after {i - 1}."}]}) + "\n" for i in range(1, 13)))
    check = GeneralCheck(TrainingSettings(model_path=str(tiny_model_dir), general_data=str(general)))
    adapter = random_lora(tiny_model_dir, tmp_path / "adapter", seed=4)
    rows = check.training_rows()
    before = check.losses(None), check.losses(adapter)
    check.release()
    assert check.training_rows() == rows
    assert (check.losses(None), check.losses(adapter)) == before
