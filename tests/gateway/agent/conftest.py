from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.agent.loop import AgentLoop, Profile, RunState
from gateway.agent.recording import StoreRecorder
from replay.records import new_id
from replay.store import TrajectoryStore
from tests.scripted import ScriptedBackend
from tools.executor import ToolOutcome
from tools.spec import ToolSpec

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}


class Box:
    """A toolbox of in-test tools: name → (schema, async function)."""

    def __init__(self, tools: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], Awaitable[Any]]]],
                 timeout: float = 0.3, needs_approval: frozenset[str] = frozenset()) -> None:
        self.tools = tools
        self.needs_approval = needs_approval
        self.timeout = timeout
        self.ran: list[tuple[str, dict[str, Any]]] = []

    def schemas(self) -> dict[str, dict[str, Any] | None]:
        return {n: s for n, (s, _) in self.tools.items()}

    def get(self, name: str) -> ToolSpec | None:
        schema, fn = self.tools[name]
        return ToolSpec(name=name, description=name, parameters=schema, run=lambda args, ctx: fn(args),
                        requires_approval=name in self.needs_approval)

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": n, "description": n, "parameters": s}}
                for n, (s, _) in self.tools.items()]

    async def execute(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        self.ran.append((name, arguments))
        try:
            result = await asyncio.wait_for(self.tools[name][1](arguments), self.timeout)
        except TimeoutError:
            return ToolOutcome("timeout", f"Tool {name} timed out after {self.timeout} s", 0.0)
        except Exception as exc:  # noqa: BLE001
            return ToolOutcome("error", f"Tool {name} failed: {exc}", 0.0)
        return ToolOutcome("ok", result if isinstance(result, str) else json.dumps(result), 0.0)


async def weather(args: dict[str, Any]) -> dict[str, Any]:
    return {"city": args["city"], "temp_c": 21}


async def broken(args: dict[str, Any]) -> Any:
    raise RuntimeError("disk on fire")


async def sleepy(args: dict[str, Any]) -> Any:
    await asyncio.sleep(5)


def default_box() -> Box:
    return Box({"get_weather": (WEATHER, weather), "broken": ({"type": "object"}, broken),
                "sleepy": ({"type": "object"}, sleepy)})


async def run_agent(store: TrajectoryStore, script: list, *, box: Box | None = None, profile: Profile | None = None,
                    task: str = "What is the weather in Paris?", events: list | None = None,
                    backend: ScriptedBackend | None = None) -> tuple[RunState, ScriptedBackend, Box]:
    box = box or default_box()
    profile = profile or Profile(name="t", model="scripted-model", system_prompt="You are a test agent.",
                                 tools=list(box.tools))
    backend = backend or ScriptedBackend(script)
    state = RunState(run_id=new_id(), profile=profile.name, messages=[
        {"role": "system", "content": profile.system_prompt}, {"role": "user", "content": task}])
    recorder = StoreRecorder(store, profile=profile, backend=backend.name)
    await recorder.start(state)
    loop = AgentLoop(profile=profile, backend=backend, toolbox=box, recorder=recorder, state=state,
                     on_event=events.append if events is not None else None)
    return await loop.run(), backend, box
