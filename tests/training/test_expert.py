"""Which of a round's episodes expert iteration trains on."""

from __future__ import annotations

from tests.extras import skip_without

skip_without("train")

from training.expert import kept
from training.metrics import Episode


def _episode(task: str, success: bool, invalid: int = 0) -> Episode:
    return Episode(task_id=task, family="calculator", success=success, steps=2, tool_calls=1 + invalid,
                   invalid_calls=invalid, needs_tools=True, faulted=False, status="completed",
                   termination_reason=None, final="4", run_id=f"{task}-{success}-{invalid}")


def test_a_round_keeps_the_clean_successes_among_the_samples_of_the_tasks_it_failed() -> None:
    # The samples are all of tasks the greedy screen failed; a clean success is worth learning even where every
    # sample of the task succeeded.
    always = [_episode("a", True), _episode("a", True)]
    sometimes = [_episode("b", True), _episode("b", False)]
    sloppy = [_episode("c", True, invalid=1), _episode("c", False)]
    never = [_episode("d", False), _episode("d", False)]
    assert [e.run_id for e in kept([*always, *sometimes, *sloppy, *never])] == ["a-True-0", "a-True-0", "b-True-0"]
