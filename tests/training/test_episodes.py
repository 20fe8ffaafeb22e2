"""One episode through the agent loop: what it asks of the backend."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.scripted import ScriptedBackend
from training.episodes import EPISODE_TIMEOUT, run_episode
from training.tasks.tools_suite import ToolsSuite


def test_an_episode_asks_for_constrained_tool_calls_only_when_told(tmp_path: Path) -> None:
    suite = ToolsSuite(tmp_path)
    task = next(t for t in suite.tasks("validation") if t.family == "calculator")
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1 + 1"}'}}]}

    def requests(constrain: bool | None) -> list[dict]:
        backend = ScriptedBackend([call, "The answer is 2."])
        extra = {} if constrain is None else {"constrain_tool_calls": constrain}
        asyncio.run(run_episode(suite, task, backend, model="scripted-model", max_tokens=32, **extra))
        return backend.requests

    constrained = requests(True)
    assert len(constrained) == 2 and all(body["constrain_tool_calls"] is True for body in constrained)
    assert all("constrain_tool_calls" not in body for body in requests(None) + requests(False))


def test_an_episode_past_its_time_limit_is_cancelled_and_fails(tmp_path: Path) -> None:
    suite = ToolsSuite(tmp_path)
    task = next(t for t in suite.tasks("validation") if t.family == "calculator")
    stuck = ScriptedBackend(["The answer is 2."], delay=30.0)  # a model call that does not come back in time
    started = time.perf_counter()
    episode = asyncio.run(run_episode(suite, task, stuck, model="scripted-model", max_tokens=32, timeout_s=0.2))
    assert time.perf_counter() - started < 5
    assert not episode.success and episode.status == "terminated" and episode.termination_reason == EPISODE_TIMEOUT
