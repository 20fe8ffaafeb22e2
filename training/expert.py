"""Expert iteration: the model's own verified, clean episodes, trained on, round after round (``[training.expert]``).

One round, from the current adapter (the SFT candidate, then each round's winner):

1. screen: one greedy episode of each of ``tasks`` train tasks (in turn through the split): the tasks it fails;
2. sample: ``samples`` episodes of each failed task at ``temperature``, through the agent loop, recorded into the
   store (source ``rollout``, ``metadata.expert_round``) and labelled with the verifier's verdict;
3. keep: the episodes the verifier accepted with no invalid call (``kept``): the recoveries and lucky draws on
   tasks it gets wrong, not what it already does;
4. train: SFT on their rows (built and leak-filtered as replay-train's) with ``replay`` rows of SFT's own
   demonstrations per kept row and general rows mixed in, from the current adapter, at the round's own
   ``learning_rate``, one checkpoint; on the kept rows alone, or at SFT's rate, a round pulls the adapter towards
   a handful of tasks and it forgets the rest (docs/training.md has the measurements);
5. validate: the checkpoint becomes the current adapter if validation ranks it higher, else the round is rejected.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.backends.local.loading import load_tokenizer
from replay.filters import Filters
from replay.store import TrajectoryStore
from replay.vocabulary import ROLLOUT
from training import data
from training.capture import label_episodes, store_recorder
from training.evaluate import Evaluator
from training.general import GeneralCheck
from training.metrics import Episode
from training.rounds import train_round
from training.settings import HarnessSettings
from training.stages import Stages
from training.tasks import Suite


def kept(episodes: list[Episode]) -> list[Episode]:
    """The sampled episodes a round trains on: verified, with no invalid call."""
    return [e for e in episodes if e.success and e.invalid_calls == 0]


async def expert_iteration(settings: HarnessSettings, suite: Suite, evaluator: Evaluator, general: GeneralCheck,
                           start: Path, start_metrics: dict[str, Any], out: Path, *, demonstrations: list[data.Example],
                           exclude: Callable[[str], bool], stage: Stages) -> tuple[Path, dict[str, Any], list[dict]]:
    """``[training.expert] rounds`` rounds from ``start`` (validated at ``start_metrics``; ``demonstrations``: SFT's
    task rows, replayed into each round): the best adapter, its validation metrics, and what each round did."""
    training, expert = settings.training, settings.training.expert
    tasks = suite.tasks("train")
    rng = random.Random(f"{training.seed}:expert")
    rng.shuffle(tasks)
    tokenizer = await asyncio.to_thread(load_tokenizer, training.model_path)
    general_rows = await asyncio.to_thread(general.training_rows)
    current, current_metrics, rounds = start, start_metrics, []
    store = TrajectoryStore(settings.store.location, settings.store)
    await store.start()
    try:
        for r in range(1, expert.rounds + 1):
            chosen = [tasks[(i + (r - 1) * expert.tasks) % len(tasks)] for i in range(min(expert.tasks, len(tasks)))]
            screen = await evaluator.episodes(suite, chosen, current, progress=f"expert round {r}: screen")
            failed = [t for t, e in zip(chosen, screen, strict=True) if not e.success]
            episodes = await evaluator.episodes(
                suite, [t for t in failed for _ in range(expert.samples)], current,
                recorder_for=store_recorder(store, training.base_model, ROLLOUT), temperature=expert.temperature,
                progress=f"expert round {r}")
            if episodes:  # none when the screen failed nothing
                await label_episodes(store, suite.name, failed, "train", episodes,
                                     metadata={"expert_round": r, "expert_run": out.parent.name})
            keep = kept(episodes)
            record: dict[str, Any] = {"round": r, "tasks": len(chosen), "failed": len(failed),
                                      "episodes": len(episodes), "succeeded": sum(e.success for e in episodes),
                                      "kept": len(keep)}
            if keep:
                rows, _ = await asyncio.to_thread(
                    data.examples_from_store, settings.store.location, Filters(ids=tuple(e.run_id for e in keep)),
                    tokenizer, max_seq_len=training.max_seq_len, exclude=exclude, rendering=training.tool_rendering)
                trained, current, current_metrics = await train_round(
                    training, suite, evaluator, rows, demonstrations=demonstrations, replay=expert.replay,
                    general_rows=general_rows, rng=rng, seed=training.seed + r, epochs=expert.epochs,
                    learning_rate=expert.learning_rate, out=out / f"round-{r}", current=current,
                    current_metrics=current_metrics, label=f"expert round {r}")
                record.update(trained)
            else:
                record["action"] = "nothing to keep"
            rounds.append(record)
            stage("expert", f"round {r}: {record['failed']} of {record['tasks']} tasks failed, "
                  f"{record['succeeded']} of {record['episodes']} episodes on them succeeded, "
                  f"{record['kept']} kept, {record.get('rows', 0)} rows → {record['action']}"
                  + (f" (validation success {record['validation']['success_rate']:.0%})" if "validation" in record
                     else ""), episodes=len(chosen) + len(episodes), tokens=record.get("tokens", 0))
    finally:
        await store.close()
    return current, current_metrics, rounds
