"""Every transition of the agent loop, driven by a scripted model, recorded in a real store."""

import asyncio

from gateway.agent.limits import Limits
from gateway.agent.loop import AgentLoop, Profile, RunState
from gateway.agent.recording import StoreRecorder
from tests.gateway.agent.conftest import WEATHER, Box, run_agent, weather
from tests.scripted import ScriptedBackend, call
from tests.stores import rows


def _tool_messages(state: RunState) -> list[dict]:
    return [m for m in state.messages if m["role"] == "tool"]


def _assert_paired(messages: list[dict]) -> None:
    """Every assistant message with tool_calls is followed at once by one tool message per call, in order."""
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            ids = [c["id"] for c in m["tool_calls"]]
            follow = messages[i + 1:i + 1 + len(ids)]
            assert [f.get("role") for f in follow] == ["tool"] * len(ids), messages
            assert [f["tool_call_id"] for f in follow] == ids


async def test_valid_call_then_final_answer(store) -> None:
    events = []
    state, backend, box = await run_agent(store, [call("get_weather", {"city": "Paris"}), "It is 21 °C in Paris."],
                                          events=events)
    assert state.status == "completed" and state.termination_reason is None
    assert state.final == "It is 21 °C in Paris."
    assert box.ran == [("get_weather", {"city": "Paris"})]
    assert '"temp_c": 21' in _tool_messages(state)[0]["content"]
    _assert_paired(state.messages)
    h = state.harness()
    assert (h["steps"], h["tool_calls"], h["invalid_tool_calls"]) == (2, 1, 0)
    assert h["usage"]["total_tokens"] == 30
    assert [e.state for e in events] == ["CALL_MODEL", "PARSE", "VALIDATE", "EXECUTE", "OBSERVE",
                                        "CALL_MODEL", "PARSE", "FINAL"]
    # the model was offered the tools and saw the result
    assert backend.requests[0]["tools"][0]["function"]["name"] == "get_weather"
    assert backend.requests[1]["messages"][-1]["role"] == "tool"
    rows = await store.get_trajectory(state.run_id, all_tenants=True)
    assert rows.status == "completed" and rows.source == "agent" and len(rows.calls) == 2


async def test_invalid_arguments_then_corrected(store) -> None:
    state, _, box = await run_agent(store, [call("get_weather", {"town": "Paris"}),
                                            call("get_weather", {"city": "Paris"}), "21 °C"])
    first = _tool_messages(state)[0]["content"]
    assert "arguments.city: 'city' is a required property" in first
    assert "arguments: Additional properties are not allowed ('town' was unexpected)" in first
    assert box.ran == [("get_weather", {"city": "Paris"})]
    assert state.status == "completed" and state.invalid_tool_calls == 1 and state.tool_calls == 2


async def test_an_integer_wider_than_64_bits_is_an_invalid_call_not_a_crash(store) -> None:
    # JSON allows it and "broken" takes any object, but the store and the limiter's repeat check take 64-bit integers.
    wide = "1" + "0" * 30
    state, _, box = await run_agent(store, [call("broken", f'{{"n": {wide}, "items": [1, -{wide}]}}'),
                                            call("get_weather", {"city": "Paris"}), "21 °C"])
    first = _tool_messages(state)[0]["content"]
    assert "arguments.n: the integer 100000000000000000000000... does not fit in 64 bits" in first
    assert "arguments.items[1]: the integer -10000000000000000000000... does not fit in 64 bits" in first
    assert box.ran == [("get_weather", {"city": "Paris"})]
    assert state.status == "completed" and state.invalid_tool_calls == 1
    rows = await store.get_trajectory(state.run_id, all_tenants=True)
    assert rows.status == "completed" and len(rows.calls) == 3


async def test_unknown_tool(store) -> None:
    state, _, box = await run_agent(store, [call("launch_rockets", {}), "ok"])
    assert "Unknown tool 'launch_rockets'" in _tool_messages(state)[0]["content"]
    assert "get_weather" in _tool_messages(state)[0]["content"]
    assert box.ran == [] and state.invalid_tool_calls == 1


async def test_broken_json_is_repaired_and_marked(store) -> None:
    state, _, box = await run_agent(store, [call("get_weather", '{"city": "Paris"'), "ok"])
    assert box.ran == [("get_weather", {"city": "Paris"})]
    assert await rows(store, "SELECT repaired, valid, status FROM tool_calls") == [(1, 1, "ok")]


async def test_text_tool_calls_are_parsed(store) -> None:
    hermes = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    fenced = 'Checking.\n```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```'
    _, _, box = await run_agent(store, [hermes, fenced, "done"])
    assert box.ran == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]


async def test_tool_timeout_and_exception_become_observations(store) -> None:
    state, _, _ = await run_agent(store, [call("sleepy", {}), call("broken", {}), "gave up"])
    timeout, failure = [m["content"] for m in _tool_messages(state)]
    assert "timed out" in timeout
    assert failure == "Tool broken failed: disk on fire"
    assert state.status == "completed"


async def test_parallel_calls_in_one_step_run_concurrently(store) -> None:
    async def slow_weather(args):
        await asyncio.sleep(0.2)
        return await weather(args)
    box = Box({"get_weather": (WEATHER, slow_weather)}, timeout=1)
    two = {"role": "assistant", "content": None, "tool_calls": [
        call("get_weather", {"city": c})["tool_calls"][0] for c in ("Paris", "Rome", "Oslo")]}
    loop = asyncio.get_running_loop()
    started = loop.time()
    state, _, _ = await run_agent(store, [two, "ok"], box=box)
    assert loop.time() - started < 0.5
    _assert_paired(state.messages)
    assert [m["content"].count("temp_c") for m in _tool_messages(state)] == [1, 1, 1]


async def test_back_to_back_repeat_is_refused_then_ends_the_run(store) -> None:
    same = lambda: call("get_weather", {"city": "Paris"})  # noqa: E731
    state, backend, box = await run_agent(store, [same(), same(), same(), "best I can do: 21 °C"])
    assert len(box.ran) == 1
    assert "Refused" in _tool_messages(state)[1]["content"]
    assert state.status == "terminated" and state.termination_reason == "loop_detected"
    # asked once, without tools, for its best final answer
    assert state.final == "best I can do: 21 °C"
    assert "tools" not in backend.requests[-1]
    assert "You must stop now" in backend.requests[-1]["messages"][-1]["content"]
    _assert_paired(state.messages)


async def test_a_failed_call_may_be_retried_as_it_was(store) -> None:
    flaky_calls = []

    async def flaky(args: dict) -> str:
        flaky_calls.append(args)
        if len(flaky_calls) == 1:
            raise TimeoutError("upstream slow")
        return "21 °C"

    box = Box({"flaky": ({"type": "object", "properties": {"city": {"type": "string"}}}, flaky)})
    same = lambda: call("flaky", {"city": "Paris"})  # noqa: E731
    state, _, _ = await run_agent(store, [same(), same(), "It is 21 °C."], box=box)
    assert state.status == "completed" and len(flaky_calls) == 2
    first, second = (m["content"] for m in _tool_messages(state))
    assert first.startswith("Tool flaky timed out") and second == "21 °C"


async def test_non_adjacent_repeats_are_allowed(store) -> None:
    paris, rome = ({"city": "Paris"}, {"city": "Rome"})
    script = [call("get_weather", paris), call("get_weather", rome), call("get_weather", paris),
              call("get_weather", rome), call("get_weather", paris), "done"]
    state, _, box = await run_agent(store, script)
    assert state.status == "completed"
    assert len(box.ran) == 5


async def test_max_steps(store) -> None:
    profile = Profile(name="t", model="scripted-model", tools=["get_weather"], limits=Limits(max_steps=3))
    cities = ["A", "B", "C", "D", "E"]
    state, backend, _ = await run_agent(store, [call("get_weather", {"city": c}) for c in cities], profile=profile)
    assert state.status == "terminated" and state.termination_reason == "max_steps"
    assert len(backend.requests) == 3 and state.budget.steps == 3


async def test_token_budget_is_held_before_each_call(store) -> None:
    """Each call's completion is capped to what the budget leaves after its prompt: the run stops at its budget,
    never past it, and the call that would not fit one completion token is not made."""
    budget = 470
    backend = ScriptedBackend([call("get_weather", {"city": c}) for c in "ABCDEFGHIJ"], usage=(0, 120), counted=True)
    profile = Profile(name="t", model="scripted-model", tools=["get_weather"], limits=Limits(max_total_tokens=budget))
    state, _, _ = await run_agent(store, [], profile=profile, backend=backend)
    assert state.termination_reason == "max_total_tokens"
    assert state.budget.total_tokens <= budget
    caps = [r.get("max_tokens") for r in backend.requests]
    assert all(isinstance(c, int) for c in caps) and min(caps) < 120, caps  # a call was capped
    spent = 0
    for request in backend.requests:  # each call was sent with exactly the room it had
        prompt = backend.count_tokens(request["messages"], request.get("tools"))
        assert request["max_tokens"] == budget - spent - prompt
        spent += prompt + min(120, request["max_tokens"])
    assert spent == state.budget.total_tokens


async def test_deadline(store) -> None:
    profile = Profile(name="t", model="scripted-model", tools=["get_weather"], limits=Limits(deadline_seconds=0.3))
    backend = ScriptedBackend([call("get_weather", {"city": c}) for c in "ABCDEFGHIJ"], delay=0.1)
    state, _, _ = await run_agent(store, [], profile=profile, backend=backend)
    assert state.termination_reason == "deadline"
    assert len(backend.requests) <= 4


async def test_tool_failures_nudge_then_stop(store) -> None:
    profile = Profile(name="t", model="scripted-model", tools=["broken"],
                      limits=Limits(max_consecutive_tool_failures=2))
    script = [call("broken", {"n": i}) for i in range(10)]
    state, backend, box = await run_agent(store, script, profile=profile)
    assert state.termination_reason == "tool_failures"
    assert len(box.ran) == 4  # nudged after 2, stopped after 2 more
    nudges = [m for m in state.messages if m["role"] == "user" and "Change your approach" in m["content"]]
    assert len(nudges) == 1
    _assert_paired(state.messages)


async def test_backend_error_ends_the_run(store) -> None:
    from gateway.backends.base import BackendUnavailable

    state, _, _ = await run_agent(store, [call("get_weather", {"city": "Paris"}), BackendUnavailable("gone")])
    assert state.status == "error" and state.termination_reason == "backend_error"
    row = await store.get_trajectory(state.run_id, all_tenants=True)
    assert row.status == "error"


class Summarizing(ScriptedBackend):
    """Answers summary requests with a fixed summary, leaving the script for the agent's own steps."""

    async def chat(self, request):
        if "Summarize the conversation" in str(request.body["messages"][0]["content"]):
            self.script.insert(0, "The model's own summary: several cities checked, all 21 °C.")
        return await super().chat(request)


def _is_summary(body: dict) -> bool:
    return "Summarize the conversation" in str(body["messages"][0]["content"])


async def test_summarization_keeps_calls_with_their_results(store) -> None:
    profile = Profile(name="t", model="scripted-model", system_prompt="sys", tools=["get_weather"],
                      context_budget_tokens=150, keep_last_turns=1)
    backend = Summarizing([call("get_weather", {"city": f"City number {i}"}) for i in range(6)] + ["final"])
    state, _, _ = await run_agent(store, [], profile=profile, backend=backend)
    assert state.status == "completed"
    steps = [b for b in backend.requests if not _is_summary(b)]
    assert len(steps) < len(backend.requests), "no summary was made"
    for body in steps:
        _assert_paired(body["messages"])
        assert body["messages"][0] == {"role": "system", "content": "sys"}
        assert any(m["role"] == "user" and "weather in Paris" in str(m["content"]) for m in body["messages"])
    after = steps[-1]["messages"]
    assert any("The model's own summary" in str(m.get("content")) for m in after)
    # what was sent is what was recorded
    recorded = await store.get_trajectory(state.run_id, all_tenants=True)
    assert [c.messages for c in recorded.calls] == [b["messages"] for b in backend.requests]


async def test_summary_falls_back_to_extractive(store) -> None:
    from gateway.backends.base import BackendUnavailable

    profile = Profile(name="t", model="scripted-model", system_prompt="sys", tools=["get_weather"],
                      context_budget_tokens=150, keep_last_turns=1)

    class Failing(ScriptedBackend):
        async def chat(self, request):
            if _is_summary(request.body):
                self.script.insert(0, BackendUnavailable("summary model down"))
            return await super().chat(request)

    backend = Failing([call("get_weather", {"city": f"City number {i}"}) for i in range(4)] + ["final"])
    state, _, _ = await run_agent(store, [], profile=profile, backend=backend)
    summary = next(m for m in backend.requests[-1]["messages"] if "[Summary" in str(m.get("content")))
    assert "called get_weather" in summary["content"]
    assert state.status == "completed"


async def test_events_and_tool_calls_are_stored(store) -> None:
    state, _, _ = await run_agent(store, [call("get_weather", {"city": "Paris"}), "done"])
    states = [r[0] for r in await rows(store, "SELECT state FROM events WHERE trajectory_id = ? ORDER BY id",
                                       state.run_id)]
    assert states == ["CALL_MODEL", "PARSE", "VALIDATE", "EXECUTE", "OBSERVE", "CALL_MODEL", "PARSE", "FINAL"]
    assert await rows(store, "SELECT name, valid, status FROM tool_calls") == [("get_weather", 1, "ok")]
    [(status, steps)] = await rows(store, "SELECT status, steps FROM agent_runs WHERE id = ?", state.run_id)
    assert (status, steps) == ("completed", 2)


async def test_resume_from_the_store(store, tmp_path) -> None:
    import orjson

    from gateway.agent.loop import RunState
    from tests.gateway.agent.conftest import default_box

    # a run killed after its first step ...
    backend = ScriptedBackend([call("get_weather", {"city": "Paris"}), "never reached"], delay=0.05)
    box = default_box()
    profile = Profile(name="t", model="scripted-model", tools=list(box.tools))
    state = RunState(run_id="run-1", profile="t", messages=[{"role": "user", "content": "weather?"}])
    recorder = StoreRecorder(store, profile=profile, backend="scripted")
    await recorder.start(state)
    task = asyncio.create_task(AgentLoop(profile=profile, backend=backend, toolbox=box, recorder=recorder,
                                         state=state).run())
    while state.budget.steps < 1 or len(backend.requests) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    # ... continues from what the store holds, with its spent budget
    [row] = await rows(store, "SELECT state FROM agent_runs WHERE id = 'run-1'")
    saved = RunState.from_dict(orjson.loads(row[0]))
    assert saved.budget.steps == 1 and saved.messages[-1]["role"] == "tool"
    saved.status, saved.termination_reason = "running", None
    resumed = await AgentLoop(profile=profile, backend=ScriptedBackend(["21 °C in Paris"]), toolbox=box,
                              recorder=recorder, state=saved).run()
    assert resumed.status == "completed" and resumed.final == "21 °C in Paris"
    assert resumed.budget.steps == 2
    _assert_paired(resumed.messages)


async def test_tools_needing_approval_are_refused_not_run(store) -> None:
    ran = []

    async def write(args):
        ran.append(args)
        return "written"
    box = Box({"write_file": ({"type": "object"}, write)}, needs_approval=frozenset({"write_file"}))
    state, _, _ = await run_agent(store, [call("write_file", {"path": "a.txt"}), "could not write"], box=box)
    assert ran == []
    assert "needs a person's approval" in _tool_messages(state)[0]["content"]
    assert state.status == "completed"


async def test_a_profile_that_constrains_tool_calls_asks_the_backend_for_it(store) -> None:
    box = Box({"get_weather": (WEATHER, lambda args: asyncio.sleep(0, {"temp_c": 21}))})
    profile = Profile(name="t", model="scripted-model", tools=list(box.tools), constrain_tool_calls=True)
    _, backend, _ = await run_agent(store, [call("get_weather", {"city": "Paris"}), "Done."], box=box,
                                    profile=profile)
    assert all(r["constrain_tool_calls"] is True for r in backend.requests)
    _, plain, _ = await run_agent(store, ["Done."], box=box)
    assert "constrain_tool_calls" not in plain.requests[0]
