"""One episode: a task of a suite run through the gateway's own agent loop on any backend, and its outcome.

The evaluator runs episodes on the embedded backend; the gate's tests run the same function on scripted
policies, so what the gate judges is what an evaluation measures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from gateway.agent.limits import Limits
from gateway.agent.loop import AgentLoop, Profile, Recorder, RunState, StepRecord
from gateway.backends.base import Backend
from replay.records import new_id
from training.metrics import Episode
from training.tasks import Suite, Task

EPISODE_LIMITS = Limits(max_steps=6, max_consecutive_tool_failures=3, max_repeats=3)
EPISODE_TIMEOUT = "episode_timeout"  # the termination reason of an episode past its wall-clock limit

log = structlog.get_logger()

# Makes (and starts) the recorder of one episode, e.g. a StoreRecorder that captures it into the store.
RecorderFor = Callable[[Task, Profile, RunState], Awaitable[Recorder]]


class _NoRecorder:
    async def step(self, state: RunState, record: StepRecord) -> None:
        pass


async def run_episode(suite: Suite, task: Task, backend: Backend, *, model: str, max_tokens: int,
                      temperature: float = 0.0, constrain_tool_calls: bool = False,
                      unseen_tools: frozenset[str] = frozenset(),
                      recorder_for: RecorderFor | None = None,
                      token_counter: Callable[..., int] | None = None, timeout_s: float | None = None,
                      messages: list[dict[str, Any]] | None = None) -> Episode:
    """``task`` run once with ``suite``'s tools (its fault injected) and judged by its verifier. ``unseen_tools``:
    the tools no train or validation task offers (``test_only_markers``), for ``unseen_tool_success_rate``.
    ``constrain_tool_calls``: the engine holds each call the model opens to an offered tool's schema.
    ``timeout_s``: the episode's wall-clock limit; past it the run is cancelled and recorded as terminated
    (``episode_timeout``), a failure, so one stuck episode cannot hold up a whole evaluation. ``messages``: the
    conversation so far (default: the system prompt and the task's prompt); the episode goes on from there, the
    task's fault counting the calls it made as run."""
    profile = Profile(name=suite.name, model=model, system_prompt=suite.system_prompt, tools=list(task.tools),
                      limits=EPISODE_LIMITS, temperature=temperature, max_tokens=max_tokens,
                      constrain_tool_calls=constrain_tool_calls)
    state = RunState(run_id=new_id(), profile=profile.name,
                     messages=list(messages) if messages else [{"role": "system", "content": suite.system_prompt},
                                                               {"role": "user", "content": task.prompt}])
    toolbox = suite.toolbox(task)
    if messages:
        toolbox.resume(messages)
    recorder = await recorder_for(task, profile, state) if recorder_for else _NoRecorder()
    loop = AgentLoop(profile=profile, backend=backend, toolbox=toolbox, recorder=recorder, state=state,
                     token_counter=token_counter)
    loop.cancelled_as = ("terminated", EPISODE_TIMEOUT)
    try:
        state = await asyncio.wait_for(loop.run(), timeout_s)
    except TimeoutError:
        log.warning("episode.timeout", task=task.id, run_id=state.run_id, seconds=timeout_s, steps=state.budget.steps)
    return Episode(
        task_id=task.id, family=task.family, success=suite.verify(task, state.final, state.messages),
        steps=state.budget.steps, tool_calls=state.tool_calls, invalid_calls=state.invalid_tool_calls,
        needs_tools=task.family != "cannot" and not task.direct, faulted=task.fault is not None, status=state.status,
        termination_reason=state.termination_reason, final=state.final, run_id=state.run_id,
        unseen_tools=bool(unseen_tools & set(task.tools)), direct=task.direct)
