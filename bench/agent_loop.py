"""The agent loop's own cost per step, and what the proxy-mode tool-call guard adds to a request.

    python bench/agent_loop.py [--steps 100] [--requests 2000]

1. Loop overhead: a zero-latency scripted model that calls a no-op tool every step, run for --steps
   steps, once with a recorder that keeps nothing (the loop alone: parse, validate, loop detection,
   execute, observe) and once with the real SQLite store (each step committed before the next).
2. Guard: the same non-streamed chat request with a tool call in the answer, through a real gateway
   app on a loopback port with a scripted model, with the client's ``tools`` (guarded) and without
   (not guarded), sequentially; the difference in p50 is what the guard adds.

Targets: under 1 ms per step for the loop itself.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gateway.agent.limits import Limits  # noqa: E402
from gateway.agent.loop import AgentLoop, Profile, RunState, StepRecord  # noqa: E402
from gateway.agent.recording import StoreRecorder  # noqa: E402
from gateway.logging import configure_logging  # noqa: E402
from replay.store import TrajectoryStore  # noqa: E402
from tests.scripted import ScriptedBackend, call  # noqa: E402
from tools.executor import ToolOutcome  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


class NoOpTools:
    def schemas(self):
        return {"noop": SCHEMA}

    def get(self, name):
        return None

    def openai_tools(self):
        return [{"type": "function", "function": {"name": "noop", "parameters": SCHEMA}}]

    async def execute(self, name, arguments):
        return ToolOutcome("ok", "done", 0.0)


class Forget:
    async def step(self, state: RunState, record: StepRecord) -> None:
        pass


async def loop_per_step(steps: int, recorder_kind: str) -> float:
    # distinct arguments each step, so loop detection never stops the run
    backend = ScriptedBackend([call("noop", {"n": i}) for i in range(steps)] + ["finished"])
    profile = Profile(name="bench", model="scripted-model", tools=["noop"],
                      limits=Limits(max_steps=steps + 1, max_repeats=0, max_consecutive_tool_failures=0))
    state = RunState(run_id=f"bench-{recorder_kind}", profile="bench",
                     messages=[{"role": "user", "content": "go"}])
    store = None
    if recorder_kind == "sqlite":
        tmp = tempfile.mkdtemp()
        store = TrajectoryStore(f"{tmp}/bench.db")
        await store.start()
        recorder = StoreRecorder(store, profile=profile, backend="scripted")
        await recorder.start(state)
    else:
        recorder = Forget()
    loop = AgentLoop(profile=profile, backend=backend, toolbox=NoOpTools(), recorder=recorder, state=state)
    started = time.perf_counter()
    result = await loop.run()
    elapsed = time.perf_counter() - started
    assert result.status == "completed", result.status
    if store is not None:
        await store.close()
    return elapsed / (steps + 1) * 1000


def guard_latency(requests: int) -> tuple[float, float]:
    from tests.gateway.api.support import serve

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    answer = call("get_weather", {"city": "Paris"}, call_id="call_1")
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "weather?"}]}
    with tempfile.TemporaryDirectory() as tmp:
        for served in serve(Path(tmp), [answer] * (2 * requests + 200)):
            with httpx.Client(base_url=served.url) as client:
                def timed(payload: dict) -> list[float]:
                    out = []
                    for _ in range(requests):
                        t = time.perf_counter()
                        r = client.post("/v1/chat/completions", json=payload)
                        out.append((time.perf_counter() - t) * 1000)
                        assert r.status_code == 200
                    return out
                timed({**body, "tools": tools})  # warm-up
                guarded = timed({**body, "tools": tools})
                plain = timed(body)
    return statistics.median(guarded), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The context grows with every step (and each step's record hashes all of it), so the per-step figure
    # rises with the run's length; 100 steps is already longer than most runs.
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    configure_logging("console", "warning")
    console = Console()
    alone = asyncio.run(loop_per_step(args.steps, "none"))
    stored = asyncio.run(loop_per_step(args.steps, "sqlite"))
    guarded, plain = guard_latency(args.requests)
    table = Table("measure", "value", "target", "")
    table.add_row("loop per step, no persistence", f"{alone:.3f} ms", "< 1 ms", "PASS" if alone < 1 else "FAIL")
    table.add_row("loop per step, committed to SQLite", f"{stored:.3f} ms", "", "")
    table.add_row("request p50 with tools (guarded)", f"{guarded:.3f} ms", "", "")
    table.add_row("request p50 without tools", f"{plain:.3f} ms", "", "")
    table.add_row("guard adds (p50)", f"{guarded - plain:+.3f} ms", "", "")
    console.print(table)


if __name__ == "__main__":
    main()
