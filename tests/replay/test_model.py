"""The read model: a stored trajectory read whole, once, into typed objects."""

from __future__ import annotations

import orjson

from replay import feedback
from replay.model import AgentRun, Feedback, ModelCall, RunEvent, ToolCall, Trajectory
from replay.store import TrajectoryStore
from tests.gateway.agent.conftest import run_agent
from tests.replay import builders as b
from tests.scripted import call


async def test_an_agent_run_reads_back_whole(store: TrajectoryStore) -> None:
    state, backend, _ = await run_agent(store, [call("get_weather", {"city": "Paris"}), "It is 21 °C in Paris."])
    await feedback.add(store, state.run_id, source="user", name="thumbs", label="up", model_call_seq=1)
    t = await store.get_trajectory(state.run_id, all_tenants=True)

    assert isinstance(t, Trajectory) and t.format == "chat" and t.source == "agent" and t.status == "completed"
    assert all(isinstance(c, ModelCall) for c in t.calls) and [c.seq for c in t.calls] == [0, 1]
    # the exact request as sent, and the reply of each call
    assert [c.messages for c in t.calls] == [r["messages"] for r in backend.requests]
    assert t.calls[0].request["tools"][0]["function"]["name"] == "get_weather"
    assert t.calls[0].reply["tool_calls"][0]["function"]["name"] == "get_weather"
    assert t.calls[1].reply["content"] == "It is 21 °C in Paris." and [c.seq for c in t.steps] == [0, 1]
    [tool] = t.tool_calls
    assert isinstance(tool, ToolCall) and tool.step == 0 and tool.name == "get_weather" and tool.succeeded
    assert orjson.loads(tool.result) == {"city": "Paris", "temp_c": 21} and not tool.refused
    assert t.events and all(isinstance(e, RunEvent) for e in t.events) and t.events[-1].state == "FINAL"
    assert isinstance(t.run, AgentRun) and t.run.profile == "t" and t.run.steps == 2
    assert t.run.state["final"] == "It is 21 °C in Paris."
    assert t.feedback == [Feedback(source="user", name="thumbs", value=None, label="up", model_call_seq=1,
                                   created_at=t.feedback[0].created_at)]
    # what the API and `harness trajectories show --json` give: plain JSON, nothing lost on the way
    shown = orjson.loads(orjson.dumps(t.to_dict()))
    assert shown["calls"][1]["response"]["choices"][0]["message"]["content"] == "It is 21 °C in Paris."
    assert shown["tool_calls"][0]["name"] == "get_weather" and shown["run"]["profile"] == "t"
    assert shown["events"][-1]["state"] == "FINAL" and shown["feedback"][0]["label"] == "up"


async def test_a_proxied_call_carries_the_result_the_client_sent_back(store: TrajectoryStore) -> None:
    first = [b.SYSTEM, {"role": "user", "content": "2+2?"}]
    asked = b.assistant_calls(b.tool_call("c1", "2+2"))
    returned = {**b.tool_row("c1", True), "status": "returned", "result": None}
    tid = await b.write(store, [(first, asked), ([*first, asked, b.tool_result("c1", "4")], b.answer("4"))],
                        source="proxy", tool_rows=[[returned], []])
    t = await store.get_trajectory(tid, all_tenants=True)
    [tool] = t.tool_calls
    assert tool.status == "returned" and tool.result == "4" and tool.succeeded
    assert t.run is None and t.events == [] and t.calls[0].prompt_token_ids == list(range(10))
    assert t.calls[1].completion_token_ids == [[101, 102]]


async def test_a_listing_reads_trajectories_without_their_calls(store: TrajectoryStore) -> None:
    tid = await b.write(store, [([b.SYSTEM, {"role": "user", "content": "hi"}], b.answer("hello"))], tenant="acme")
    [listed] = await store.list_trajectories(tenant="acme")
    assert listed.id == tid and listed.calls == [] and listed.n_calls == 1
    assert listed.summary()["tenant"] == "acme" and "calls" not in listed.summary()


def test_a_stored_call_reads_its_packed_columns_without_resolving() -> None:
    from replay.model import StoredCall
    from replay.records import pack

    def stored(**kw: object) -> StoredCall:
        fields = dict(trajectory_id="t", id="c", seq=0, created_at=0.0, status="ok", request_keys=["a", "b"],
                      tools_key="k", reply_keys=["r0", "r1"], params=None, response=None)
        return StoredCall(**{**fields, **kw})  # type: ignore[arg-type]

    call = stored(params='{"purpose":"summary","temperature":0}', response='{"choices":[{"finish_reason":"stop"}]}',
                  packed_completion_ids=pack([[5, 6], [7]]))
    assert call.declared_purpose == "summary" and stored().declared_purpose is None
    assert call.finish_reason == "stop" and stored().finish_reason is None
    assert call.reply_key == "r0" and call.body_keys == {"a", "b", "k", "r0", "r1"}
    assert call.first_completion_ids() == b"[5,6]"
    assert stored(packed_completion_ids=pack([None, [7]])).first_completion_ids() is None
    resolved = call.to_model_call({"a": {"role": "user", "content": "hi"}, "b": {"role": "user", "content": "there"},
                             "k": [{"type": "function"}], "r0": {"role": "assistant", "content": "x"}})
    assert resolved.messages[1]["content"] == "there" and resolved.purpose == "summary"
    assert resolved.reply == {"role": "assistant", "content": "x"} and resolved.completion_token_ids == [[5, 6], [7]]
