"""Capturing a suite's split into the trajectory store: the solver's demonstrations (source ``demo``) and the
model's own attempts through the agent loop (source ``agent``), each with the verifier's verdict.

Both are stored exactly as the gateway stores traffic: demonstrations through the replay importer (a model
call per assistant turn), attempts through the agent loop's own recorder. Every trajectory gets its task id
and a ``verifier`` feedback row ``task_success`` (1 or 0), which the reward engine reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.agent.loop import Profile, RunState
from gateway.agent.recording import StoreRecorder
from replay import feedback, runs
from replay.importer import Conversation, ImportResult, build_op
from replay.records import WriteOp
from replay.store import TrajectoryStore
from replay.vocabulary import AGENT, DEMO
from training.episodes import RecorderFor
from training.evaluate import Evaluator, spread
from training.metrics import Episode, metrics_of
from training.settings import HarnessSettings
from training.tasks import Task, get_suite

# The sampling temperature of capture's model attempts (``harness tasks capture --temperature``): varied enough that
# several attempts at a task differ, low enough that some succeed.
ATTEMPT_TEMPERATURE = 0.7


@dataclass
class CaptureResult:
    demonstrations: int = 0
    attempts: int = 0
    attempts_succeeded: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)


def store_recorder(store: TrajectoryStore, base_model: str, source: str) -> RecorderFor:
    """Records each episode into ``store`` as the gateway records an agent run, with ``source``."""

    async def recorder_for(task: Task, profile: Profile, state: RunState) -> StoreRecorder:
        recorder = StoreRecorder(store, profile=profile, backend=f"local:{base_model}", source=source)
        await recorder.start(state)
        return recorder

    return recorder_for


async def label_episodes(store: TrajectoryStore, suite: str, tasks: list[Task], split: str, episodes: list[Episode], *,
                         groups: dict[str, str] | None = None, metadata: dict[str, Any] | None = None) -> None:
    """Give each recorded episode its task id, group id (``groups``: task id -> group), metadata and the verifier's
    ``task_success`` feedback, in one transaction."""
    by_id = {t.id: t for t in tasks}
    statements = []
    for episode in episodes:
        task = by_id[episode.task_id]
        extra = {"suite": suite, "split": split, "family": task.family, **(metadata or {})}
        if task.fault is not None:
            extra["fault"] = {"tool": task.fault.tool, "kind": task.fault.kind, "call": task.fault.call}
        statements.append(runs.task_statement(episode.run_id, task_id=episode.task_id,
                                              group_id=(groups or {}).get(episode.task_id), metadata=extra))
        statements.append(feedback.statement(episode.run_id, source="verifier", name="task_success",
                                             value=1.0 if episode.success else 0.0))
    await store.write(WriteOp(statements=statements))


async def capture(settings: HarnessSettings, suite_name: str, split: str, *, demos: bool = True, attempts: int = 1,
                  sample: int | None = None, temperature: float = ATTEMPT_TEMPERATURE) -> CaptureResult:
    """Demonstrations of every task of ``split``; ``attempts`` model attempts at each task (or at ``sample`` tasks
    spread evenly over the split, so every family is attempted)."""
    suite = get_suite(suite_name, data_dir=settings.training.tasks_dir)
    tasks = suite.tasks(split)
    result = CaptureResult()
    store = TrajectoryStore(settings.store.location, settings.store)
    await store.start()
    try:
        if demos:
            conversations = []
            for i, task in enumerate(tasks):
                messages = [{"role": "system", "content": suite.system_prompt}, *await suite.solve(task)]
                conversations.append(Conversation(
                    line=i + 1, messages=messages, tools=suite.toolbox(task).openai_tools(), task_id=task.id,
                    model=settings.training.base_model,
                    metadata={"suite": suite.name, "split": split, "family": task.family}))
            imported = ImportResult()
            op = build_op(conversations, source=DEMO, result=imported)
            op.statements += [feedback.statement(tid, source="verifier", name="task_success", value=1.0)
                              for tid in imported.ids]
            await store.write(op)
            result.demonstrations = len(conversations)
        if attempts:
            attempted = spread(tasks, sample or 0)
            async with Evaluator(settings.training) as evaluator:
                episodes = []
                for _ in range(attempts):
                    episodes += await evaluator.episodes(
                        suite, attempted, recorder_for=store_recorder(store, settings.training.base_model, AGENT),
                        temperature=temperature, progress=f"attempts on {split}")
            await label_episodes(store, suite.name, tasks, split, episodes)
            result.attempts = len(episodes)
            result.attempts_succeeded = sum(e.success for e in episodes)
            result.metrics = metrics_of(episodes)
    finally:
        await store.close()
    return result
