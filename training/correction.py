"""On-policy correction (DAgger): the states the current adapter reaches itself, labelled by a teacher, trained on.

Demonstrations only show states a perfect agent reaches; a policy that slips once is somewhere no row taught it.
Each round (``[training.correction]``), from the current adapter (the SFT candidate, then each round's winner):

1. run: one greedy episode of each of ``tasks`` train tasks (in turn through the split) and ``samples`` more at
   ``temperature``, through the agent loop, recorded into the store (source ``rollout``,
   ``metadata.correction_round``) with the verifier's verdict;
2. label: at every assistant turn of every episode, the teacher's turn for the conversation so far (its prefix:
   the policy's own calls, wrong ones included, and the results they got); where the policy's turn does
   something else (``teacher.disagreement``), the state becomes a row: the policy's prefix as context, the
   teacher's turn labelled. An episode that went off track gives a row at its first wrong step and at each
   later state it reached where it still disagrees: what to do after its own mistake;
3. aggregate: the rows join those of earlier rounds (DAgger's aggregation; ``aggregate = false`` keeps the
   round's alone), with ``replay`` rows of SFT's demonstrations per row and general rows at ``general_share``;
4. train: SFT on them from the current adapter, at the round's ``learning_rate``, one checkpoint;
5. validate: the checkpoint becomes the current adapter if validation ranks it higher, else the round is rejected.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

from gateway.agent.loop import Profile, RunState
from gateway.backends.local.loading import load_tokenizer
from gateway.prompting import Message
from replay.store import TrajectoryStore
from replay.vocabulary import ROLLOUT
from training import data
from training.capture import label_episodes, store_recorder
from training.episodes import RecorderFor
from training.evaluate import Evaluator
from training.general import GeneralCheck
from training.rounds import train_round
from training.settings import HarnessSettings
from training.stages import Stages
from training.tasks import Suite, Task
from training.teacher import Teacher, disagreement


def keeping_states(states: dict[str, RunState], inner: RecorderFor | None = None) -> RecorderFor:
    """A recorder factory that also keeps each episode's run state by run id: its messages once it has ended."""

    async def recorder_for(task: Task, profile: Profile, state: RunState) -> Any:
        states[state.run_id] = state
        return await inner(task, profile, state) if inner else _Discard()

    return recorder_for


class _Discard:
    async def step(self, state: RunState, record: Any) -> None:
        pass


async def corrections(suite: Suite, task: Task, messages: list[Message], teacher: Teacher,
                      kinds: Counter[str]) -> list[tuple[list[Message], Message]]:
    """Every state of one episode (``messages``: system prompt to end) where the policy's turn disagrees with the
    teacher's: (the prefix, the teacher's turn); ``kinds`` counts the disagreements, ``agreed`` the rest."""
    tools = suite.toolbox(task).openai_tools() or None
    out = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = messages[:i]
        turn = await teacher.next_turn(suite, task, prefix, tools)
        if turn is None:
            kinds["teacher_dropped"] += 1
            continue
        kind = await disagreement(suite, task, prefix, tools, message, turn)
        kinds[kind or "agreed"] += 1
        if kind is not None:
            out.append((prefix, turn))
    return out


async def correction_rounds(settings: HarnessSettings, suite: Suite, evaluator: Evaluator, general: GeneralCheck,
                            start: Path, start_metrics: dict[str, Any], out: Path, *, teacher: Teacher,
                            demonstrations: list[data.Example], exclude: Any,
                            stage: Stages) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """``[training.correction] rounds`` rounds from ``start`` (validated at ``start_metrics``): the best adapter,
    its validation metrics, and what each round did."""
    training, settings_c = settings.training, settings.training.correction
    tasks = suite.tasks("train")
    by_id = {t.id: t for t in tasks}
    rng = random.Random(f"{training.seed}:correction")
    rng.shuffle(tasks)
    tokenizer = await asyncio.to_thread(load_tokenizer, training.model_path)
    general_rows = await asyncio.to_thread(general.training_rows)
    current, current_metrics, rounds = start, start_metrics, []
    aggregated: list[data.Example] = []
    seen: set[tuple[int, ...]] = set()
    store = TrajectoryStore(settings.store.location, settings.store)
    await store.start()
    try:
        for r in range(1, settings_c.rounds + 1):
            chosen = [tasks[(i + (r - 1) * settings_c.tasks) % len(tasks)]
                      for i in range(min(settings_c.tasks, len(tasks)))]
            states: dict[str, RunState] = {}
            recorder = keeping_states(states, store_recorder(store, training.base_model, ROLLOUT))
            episodes = await evaluator.episodes(suite, chosen, current, recorder_for=recorder,
                                                progress=f"correction round {r}: greedy")
            if settings_c.samples:
                episodes += await evaluator.episodes(
                    suite, [t for t in chosen for _ in range(settings_c.samples)], current, recorder_for=recorder,
                    temperature=settings_c.temperature, progress=f"correction round {r}: sampled")
            await label_episodes(store, suite.name, chosen, "train", episodes,
                                 metadata={"correction_round": r, "correction_run": out.parent.name})
            kinds: Counter[str] = Counter()
            rows = []
            for episode in episodes:
                task = by_id[episode.task_id]
                tools = suite.toolbox(task).openai_tools() or None
                for prefix, turn in await corrections(suite, task, states[episode.run_id].messages, teacher, kinds):
                    if exclude(data.row_text([*prefix, turn])):
                        kinds["excluded"] += 1
                        continue
                    try:
                        row = data.render_example(tokenizer, prefix, tools, completion=turn,
                                                  max_seq_len=training.max_seq_len, rendering=training.tool_rendering,
                                                  trajectory_id=episode.run_id, kind="task",
                                                  seq=sum(m.get("role") == "assistant" for m in prefix),
                                                  recovered=any(data.is_failed_tool_result(m) for m in prefix))
                    except data.TooLong:
                        kinds["too_long"] += 1
                        continue
                    if tuple(row.input_ids) not in seen:  # the same state reached twice is one row
                        seen.add(tuple(row.input_ids))
                        rows.append(row)
            aggregated = aggregated + rows if settings_c.aggregate else rows
            disagreements = {k: v for k, v in kinds.items() if k not in ("agreed", "teacher_dropped", "excluded",
                                                                         "too_long")}
            record: dict[str, Any] = {
                "round": r, "tasks": len(chosen), "episodes": len(episodes),
                "succeeded": sum(e.success for e in episodes), "states": sum(kinds.values()),
                "disagreements": disagreements, "agreed": kinds["agreed"], "teacher": teacher.name,
                "teacher_dropped": kinds["teacher_dropped"], "teacher_failures": dict(getattr(teacher, "failures", {})),
                "new_rows": len(rows), "correction_rows": len(aggregated)}
            if rows:  # a round that found nothing new has nothing new to train on
                trained, current, current_metrics = await train_round(
                    training, suite, evaluator, aggregated, demonstrations=demonstrations, replay=settings_c.replay,
                    general_rows=general_rows, rng=rng, seed=training.seed + 100 + r, epochs=settings_c.epochs,
                    learning_rate=settings_c.learning_rate, out=out / f"round-{r}", current=current,
                    current_metrics=current_metrics, label=f"correction round {r}")
                record.update(trained)
            else:
                record["action"] = "nothing to correct"
            rounds.append(record)
            kinds_text = ", ".join(f"{k} {v}" for k, v in sorted(disagreements.items())) or "none"
            stage("correction", f"round {r}: {record['succeeded']} of {len(episodes)} episodes solved; "
                  f"{sum(disagreements.values())} of {record['states']} states corrected ({kinds_text}); "
                  f"{len(rows)} new rows, {len(aggregated)} in all → {record['action']}"
                  + (f" (validation success {record['validation']['success_rate']:.0%})" if "validation" in record
                     else ""), episodes=len(episodes), tokens=record.get("tokens", 0))
    finally:
        await store.close()
    return current, current_metrics, rounds
