"""One round on from a trained adapter, as expert iteration and on-policy correction take theirs: the round's rows with
SFT's demonstrations replayed and general rows mixed in, trained from the current adapter at the round's own rate,
one checkpoint, kept when validation ranks it higher than the current adapter."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from gateway.backends.local.heap import release_free_memory
from training import data
from training.evaluate import Evaluator
from training.metrics import rank
from training.settings import TrainingSettings
from training.sft import SFTConfig, SFTResult, train_sft
from training.tasks import Suite


async def train_apart(evaluator: Evaluator, model_path: str | None, rows: list[data.Example], config: SFTConfig,
                      out: Path, *, init_adapter: Path | None = None) -> SFTResult:
    """``train_sft`` off the event loop with the memory to itself: the evaluator's backend closed first (it starts
    again on the next evaluation), the trained model dropped and the heap's free pages returned after."""
    await evaluator.pause()
    result = await asyncio.to_thread(train_sft, model_path, rows, config, out, init_adapter=init_adapter)
    result.model = None
    release_free_memory()
    return result


async def train_round(training: TrainingSettings, suite: Suite, evaluator: Evaluator, rows: list[data.Example], *,
                      demonstrations: list[data.Example], replay: float, general_rows: list[data.Example],
                      rng: random.Random, seed: int, epochs: float, learning_rate: float, out: Path, current: Path,
                      current_metrics: dict[str, Any], label: str) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """What the round did (rows trained, tokens, checkpoint, validation, ``kept`` or ``rejected``), and the current
    adapter after it with its validation metrics. ``replay``: demonstrations per row of the round's own."""
    replayed = rng.sample(demonstrations, min(len(demonstrations), round(replay * len(rows))))
    mixed = data.mix(rows + replayed, general_rows, min_recovered_share=0.0, general_share=training.general_share,
                     seed=seed)
    result = await train_apart(evaluator, training.model_path, mixed, SFTConfig.from_settings(
        training, epochs=epochs, learning_rate=learning_rate, checkpoints=1), out, init_adapter=current)
    checkpoint = result.checkpoints[-1]
    report = await evaluator.evaluate(suite.name, "validation", checkpoint, label=label)
    better = rank(report.metrics) > rank(current_metrics)
    record = {"rows": len(mixed), "tokens": result.tokens, "checkpoint": str(checkpoint),
              "validation": report.metrics, "action": "kept" if better else "rejected"}
    return (record, checkpoint, report.metrics) if better else (record, current, current_metrics)
