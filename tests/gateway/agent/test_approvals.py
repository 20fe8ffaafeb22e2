"""Held calls: the loop pauses for approval, and goes on with the decisions (approve, deny, expiry)."""

from gateway.agent.context import with_tool_results
from gateway.agent.loop import APPROVED, EXPIRED, AgentLoop, Profile, RunState
from gateway.agent.recording import StoreRecorder
from replay import approvals
from tests.gateway.agent.conftest import WEATHER, Box, weather
from tests.gateway.agent.test_loop import _assert_paired
from tests.scripted import ScriptedBackend, call
from tests.stores import rows

WRITE = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def _box(ran: list) -> Box:
    async def write(args):
        ran.append(args)
        return f"wrote {args['path']}"
    return Box({"write_file": (WRITE, write), "get_weather": (WEATHER, weather)},
               needs_approval=frozenset({"write_file"}))


def _two_calls() -> dict:
    first, second = call("write_file", {"path": "a.txt"}, "c1"), call("get_weather", {"city": "Paris"}, "c2")
    return {**first, "tool_calls": first["tool_calls"] + second["tool_calls"]}


async def _paused(store, backend, box) -> tuple[AgentLoop, RunState]:
    profile = Profile(name="t", model="scripted-model", tools=list(box.tools))
    state = RunState(run_id="run-1", profile="t", messages=[{"role": "user", "content": "write a.txt"}])
    recorder = StoreRecorder(store, profile=profile, backend="scripted", approval_expiry_seconds=60)
    await recorder.start(state)
    loop = AgentLoop(profile=profile, backend=backend, toolbox=box, recorder=recorder, state=state,
                     hold_for_approval=True)
    return loop, await loop.run()


async def test_a_held_call_pauses_the_run_and_approval_runs_it(store) -> None:
    ran: list = []
    box = _box(ran)
    backend = ScriptedBackend([_two_calls(), "Wrote a.txt; 21 °C in Paris."])
    loop, state = await _paused(store, backend, box)
    # the other call ran; the held one did not, and the model was not called again
    assert state.status == "pending_approval" and ran == [] and len(backend.requests) == 1
    assert [n for n, _ in box.ran] == ["get_weather"]
    [held] = await approvals.list_approvals(store)
    assert (held["tool"], held["arguments"], held["call_id"], held["status"]) == (
        "write_file", {"path": "a.txt"}, "c1", "pending")
    assert 59 < held["expires_at"] - held["created_at"] <= 60
    assert await rows(store, "SELECT status FROM trajectories") == [("pending_approval",)]
    assert sorted(await rows(store, "SELECT call_id, status FROM tool_calls")) == [
        ("c1", "pending_approval"), ("c2", "ok")]

    row, changed = await approvals.decide(store, held["id"], approve=True, reason=None, by="ana",
                                          now=held["created_at"])
    assert changed and row["status"] == APPROVED and row["decided_by"] == "ana"
    # a second decision changes nothing
    assert (await approvals.decide(store, held["id"], approve=False, reason=None, by="bo", now=0))[1] is False
    final = await loop.run(await approvals.decisions(store, "run-1"))
    assert final.status == "completed" and final.final == "Wrote a.txt; 21 °C in Paris."
    assert ran == [{"path": "a.txt"}]
    _assert_paired(final.messages)
    assert backend.requests[1]["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "wrote a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"city": "Paris", "temp_c": 21}'}]
    assert sorted(await rows(store, "SELECT call_id, status, result FROM tool_calls")) == [
        ("c1", "ok", "wrote a.txt"), ("c2", "ok", '{"city": "Paris", "temp_c": 21}')]
    states = [s for (s,) in await rows(store, "SELECT state FROM events ORDER BY id")]
    assert "AWAIT_APPROVAL" in states and states[states.index("AWAIT_APPROVAL") + 1] == "APPROVAL"


async def test_denial_becomes_a_tool_result_and_the_run_goes_on(store) -> None:
    ran: list = []
    backend = ScriptedBackend([call("write_file", {"path": "a.txt"}, "c1"), "I could not write the file."])
    loop, state = await _paused(store, backend, _box(ran))
    [held] = await approvals.list_approvals(store)
    await approvals.decide(store, held["id"], approve=False, reason="not that file", by="ana", now=held["created_at"])
    final = await loop.run(await approvals.decisions(store, "run-1"))
    assert ran == [] and final.status == "completed"
    note = backend.requests[1]["messages"][-1]
    assert note["role"] == "tool" and note["content"].startswith("Denied: a person did not allow this call to "
                                                                  "write_file (not that file).")
    assert await rows(store, "SELECT status FROM tool_calls") == [("denied",)]


async def test_an_expired_approval_cannot_be_decided_and_the_run_goes_on_without_it(store) -> None:
    ran: list = []
    backend = ScriptedBackend([call("write_file", {"path": "a.txt"}, "c1"), "Nobody approved it."])
    loop, _ = await _paused(store, backend, _box(ran))
    [held] = await approvals.list_approvals(store)
    late = held["expires_at"] + 1
    assert (await approvals.decide(store, held["id"], approve=True, reason=None, by="ana", now=late))[1] is False
    assert await approvals.settled_runs(store) == []
    assert await approvals.expire(store, late) == 1
    assert await approvals.settled_runs(store) == ["run-1"]
    decided = await approvals.decisions(store, "run-1")
    assert [d["status"] for d in decided.values()] == [EXPIRED]
    final = await loop.run(decided)
    assert ran == [] and final.final == "Nobody approved it."
    assert "nobody approved this call to write_file in time" in backend.requests[1]["messages"][-1]["content"]


async def test_a_loop_that_cannot_wait_refuses_held_calls(store) -> None:
    ran: list = []
    box = _box(ran)
    profile = Profile(name="t", model="scripted-model", tools=list(box.tools))
    state = RunState(run_id="r", profile="t", messages=[{"role": "user", "content": "write"}])
    recorder = StoreRecorder(store, profile=profile, backend="scripted")
    await recorder.start(state)
    final = await AgentLoop(profile=profile, backend=ScriptedBackend([call("write_file", {"path": "a"}), "ok"]),
                            toolbox=box, recorder=recorder, state=state).run()
    assert final.status == "completed" and ran == [] and await approvals.list_approvals(store, status=None) == []


def test_results_join_their_calls_before_a_nudge_and_in_call_order() -> None:
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]},
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "user", "content": "nudge"}]
    merged = with_tool_results(messages, [{"role": "tool", "tool_call_id": "a", "content": "A"}])
    assert [m.get("tool_call_id") or m["content"] for m in merged] == ["go", None, "a", "b", "nudge"]
