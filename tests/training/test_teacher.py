"""Teachers: the suite's solver as a policy from any state, a served model as a teacher through a real gateway, and
how a policy's turn is compared with the teacher's."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("train")

from tests.scripted import ScriptedBackend
from training.correction import corrections
from training.episodes import run_episode
from training.metrics import Episode
from training.tasks import Suite, Task
from training.tasks.tools_suite import ToolsSuite
from training.teacher import SolverTeacher, disagreement

FIXTURE = Path(__file__).parent / "fixtures" / "failed_episodes.json"


class TeacherBackend(ScriptedBackend):
    """A backend whose every reply is the suite's next turn for the conversation it is sent."""

    def __init__(self, suite: Suite, task: Task) -> None:
        super().__init__([])
        self.suite, self.task = suite, task

    async def _next(self, request: Any) -> dict[str, Any]:
        self.requests.append(request.body)
        return await self.suite.next_turn(self.task, request.body["messages"])


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> ToolsSuite:
    return ToolsSuite(tmp_path_factory.mktemp("tasks"))


def finish(suite: Suite, task: Task, messages: list[dict[str, Any]] | None = None) -> Episode:
    """The teacher's continuation of ``messages`` (default: the start), run to the end through the agent loop."""
    return asyncio.run(run_episode(suite, task, TeacherBackend(suite, task), model="teacher", max_tokens=64,
                                   messages=messages))


def call(name: str, arguments: dict[str, Any], call_id: str = "call_p1") -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def result(text: str, call_id: str = "call_p1") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def start(suite: Suite, task: Task) -> list[dict[str, Any]]:
    return [{"role": "system", "content": suite.system_prompt}, {"role": "user", "content": task.prompt}]


def first(suite: ToolsSuite, family: str, split: str = "test", **match: Any) -> Task:
    return next(t for t in suite.tasks(split) if t.family == family
                and all(getattr(t, k) == v for k, v in match.items()))


def test_the_solver_as_a_policy_solves_every_task_of_every_split_through_the_loop(suite: ToolsSuite) -> None:
    failed = [t.id for t in suite.all_tasks() if not finish(suite, t).success]
    assert failed == []


def test_after_a_failed_call_it_retries_and_the_episode_recovers(suite: ToolsSuite) -> None:
    task = next(t for t in suite.tasks("train") if t.family == "recovery" and t.fault.tool == "sql_query")
    messages = start(suite, task)
    turn = asyncio.run(suite.next_turn(task, messages))
    query = json.loads(turn["tool_calls"][0]["function"]["arguments"])
    # The policy made the call, the fault hit it; the teacher makes it again, as it was.
    failure = "Tool sql_query timed out after 10s" if task.fault.kind == "timeout" else "Tool sql_query failed: x"
    messages += [call("sql_query", query), result(failure)]
    again = asyncio.run(suite.next_turn(task, messages))
    assert again["tool_calls"][0]["function"]["name"] == "sql_query"
    assert json.loads(again["tool_calls"][0]["function"]["arguments"]) == query
    assert finish(suite, task, messages).success


def test_after_a_correct_look_up_it_answers_instead_of_calculating(suite: ToolsSuite) -> None:
    task = first(suite, "sql_lookup", expected=next(t.expected for t in suite.tasks("test")
                                                      if t.family == "sql_lookup" and isinstance(t.expected, int)))
    messages = start(suite, task)
    looked_up = asyncio.run(suite.next_turn(task, messages))
    query = json.loads(looked_up["tool_calls"][0]["function"]["arguments"])["query"]
    # The policy's own query, written its way, returns the same rows: the step counts as done.
    output = asyncio.run(suite.clean_toolbox(task).execute("sql_query", {"query": query})).output
    messages += [call("sql_query", {"query": query.replace(" = ", "=")}), result(output),
                 call("calculator", {"expression": f"{task.expected} * 100"}, "call_p2"),
                 result(str(task.expected * 100), "call_p2")]
    turn = asyncio.run(suite.next_turn(task, messages))
    assert "tool_calls" not in turn and suite.verify(task, turn["content"], messages)
    assert finish(suite, task, messages).success


def test_an_empty_result_for_an_unknown_name_is_declined_not_invented(suite: ToolsSuite) -> None:
    task = next(t for t in suite.tasks("test") if t.family == "cannot" and "sql_query" in t.tools
                and asyncio.run(suite.solve(t))[1].get("tool_calls"))
    demo = asyncio.run(suite.solve(task))
    messages = start(suite, task) + [call("sql_query", json.loads(demo[1]["tool_calls"][0]["function"]["arguments"])),
                                     result(demo[2]["content"])]
    turn = asyncio.run(suite.next_turn(task, messages))
    assert "tool_calls" not in turn and suite.verify(task, turn["content"], messages)


def test_a_chain_is_finished_from_where_it_stands_after_an_invalid_call(suite: ToolsSuite) -> None:
    task = first(suite, "chain")
    demo = asyncio.run(suite.solve(task))
    messages = start(suite, task) + demo[1:3] + [
        call("calculator", {"expr": "1 +"}, "call_p9"),
        result("Invalid call to calculator: 'expression' is a required property. Fix the call and try again.",
               "call_p9")]
    turn = asyncio.run(suite.next_turn(task, messages))
    assert turn["tool_calls"][0]["function"] == demo[3]["tool_calls"][0]["function"]
    assert finish(suite, task, messages).success


def test_independent_calls_are_made_together_and_a_missing_one_alone(suite: ToolsSuite) -> None:
    task = first(suite, "service_parallel", "train")
    messages = start(suite, task)
    together = asyncio.run(suite.next_turn(task, messages))
    calls = [c["function"] for c in together["tool_calls"]]
    assert len(calls) == 2 and calls[0]["name"] == calls[1]["name"] and calls[0] != calls[1]
    # The policy made them one at a time: after the first, the teacher makes the second alone; then it answers.
    outputs = [asyncio.run(suite.clean_toolbox(task).execute(c["name"], json.loads(c["arguments"]))).output
               for c in calls]
    messages += [call(calls[0]["name"], json.loads(calls[0]["arguments"])), result(outputs[0])]
    second = asyncio.run(suite.next_turn(task, messages))
    assert [c["function"] for c in second["tool_calls"]] == [calls[1]]
    messages += [call(calls[1]["name"], json.loads(calls[1]["arguments"]), "call_p2"), result(outputs[1], "call_p2")]
    answer = asyncio.run(suite.next_turn(task, messages))
    assert "tool_calls" not in answer and suite.verify(task, answer["content"], messages)
    # Making only the first of the two is told apart from a wrong call.
    policy = call(calls[0]["name"], json.loads(calls[0]["arguments"]))
    tools = suite.toolbox(task).openai_tools()
    kind = asyncio.run(disagreement(suite, task, start(suite, task), tools, policy, together))
    assert kind == "calls_apart"
    assert asyncio.run(disagreement(suite, task, start(suite, task), tools, together, together)) is None


def test_where_no_offered_tool_fits_it_answers_at_once(suite: ToolsSuite) -> None:
    task = first(suite, "no_tool", "train")
    turn = asyncio.run(suite.next_turn(task, start(suite, task)))
    assert "tool_calls" not in turn and suite.verify(task, turn["content"], [*start(suite, task), turn])
    policy = call(task.tools[0], {})
    tools = suite.toolbox(task).openai_tools()
    assert asyncio.run(disagreement(suite, task, start(suite, task), tools, policy, turn)) == \
        "called_instead_of_answering"


def test_calls_the_plan_does_not_need_are_left_aside(suite: ToolsSuite) -> None:
    task = first(suite, "calculator")
    messages = start(suite, task) + [call("sql_query", {"query": "SELECT name FROM products"}),
                                     result('{"columns": ["name"], "rows": [["desk lamp"]]}')]
    assert finish(suite, task, messages).success


def test_the_fault_fires_where_it_would_have_when_an_episode_is_continued(suite: ToolsSuite) -> None:
    task = next(t for t in suite.tasks("train") if t.family == "recovery" and t.fault.tool == "calculator")
    box = suite.toolbox(task)
    box.resume([call("calculator", {"expression": "1+1"}), result("2"),
                call("calculator", {"expression": "1+"}, "call_p2"),
                result("Invalid call to calculator: x", "call_p2")])
    assert box.counts == {"calculator": 1}  # the invalid call never ran
    outcome = asyncio.run(box.execute("calculator", {"expression": "2+2"}))
    assert outcome.output == "4"  # the fault was the first call's, which the policy already spent


def test_disagreements_are_judged_by_what_a_turn_does(suite: ToolsSuite) -> None:
    task = first(suite, "sql_lookup", split="train")
    messages = start(suite, task)
    tools = suite.toolbox(task).openai_tools()
    right = asyncio.run(suite.next_turn(task, messages))
    query = json.loads(right["tool_calls"][0]["function"]["arguments"])["query"]

    def judge(policy: dict[str, Any], teacher: dict[str, Any] = right, history: list | None = None) -> str | None:
        return asyncio.run(disagreement(suite, task, history or messages, tools, policy, teacher))

    assert judge(call("sql_query", {"query": query.replace("SELECT ", "select ")})) is None  # same rows
    assert judge({"role": "assistant", "content": "It is 42."}) == "answered_instead_of_calling"
    assert judge(call("calculator", {"expression": "1+1"})) == "wrong_tool"
    assert judge(call("sql_query", {"query": "SELECT name FROM employees"})) == "wrong_arguments"
    assert judge(call("sql_query", {"sql": query})) == "invalid_call"
    demo = asyncio.run(suite.solve(task))
    done = messages + demo[1:3]
    answer = asyncio.run(suite.next_turn(task, done))
    assert judge({"role": "assistant", "content": answer["content"]}, answer, done) is None
    assert judge({"role": "assistant", "content": "I cannot say."}, answer, done) == "wrong_answer"
    assert judge(call("sql_query", {"query": query}, "call_p5"), answer, done) == "called_instead_of_answering"


def test_an_off_track_episode_gives_a_row_at_each_state_it_still_disagrees(suite: ToolsSuite) -> None:
    task = first(suite, "sql_lookup", split="train")
    demo = asyncio.run(suite.solve(task))
    value = task.expected
    episode = start(suite, task) + demo[1:3] + [call("calculator", {"expression": f"{value} * 100"}, "call_p2"),
                                                 result("x", "call_p2"),
                                                 {"role": "assistant", "content": "The answer is 570000."}]
    kinds: Counter[str] = Counter()
    rows = asyncio.run(corrections(suite, task, episode, SolverTeacher(), kinds))
    assert kinds == {"agreed": 1, "called_instead_of_answering": 1, "wrong_answer": 1}
    assert [len(prefix) for prefix, _ in rows] == [4, 6]  # after the look-up, and after its own needless call
    assert all(suite.verify(task, turn["content"], prefix) for prefix, turn in rows)


def test_from_every_state_of_real_failed_episodes_the_teacher_finishes_the_task(suite: ToolsSuite) -> None:
    """Episodes the README's SFT adapter failed on train tasks, recorded by its first correction round
    (``bench/make_failed_episodes.py``): from each state it reached, the teacher's continuation, run to the end
    through the agent loop, passes the verifier."""
    recorded = json.loads(FIXTURE.read_text())
    families = Counter()
    for episode in recorded["episodes"]:
        task = suite.task(episode["task_id"])
        messages = episode["messages"]
        states = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for i in states:
            assert finish(suite, task, messages[:i]).success, (task.id, i)
        families[task.family] += 1
    assert len(families) >= 5, families


class StandInTeacher:
    """An OpenAI-compatible upstream whose model is a scripted teacher: the solver's turn for the conversation it is
    sent, except after a failed tool result, where it writes a call the tool's schema refuses."""

    def __init__(self, suite: Suite, task: Task) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.suite, self.task, self.requests = suite, task, 0

        async def chat(request: Any) -> JSONResponse:
            body = await request.json()
            self.requests += 1
            messages = body["messages"]
            if messages[-1]["role"] == "tool" and messages[-1]["content"].startswith("Tool "):
                turn = call(self.task.fault.tool, {"wrong": 1}, "call_bad")
            else:
                turn = await self.suite.next_turn(self.task, messages)
            return JSONResponse({"id": "chatcmpl-t", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "message": turn, "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})

        async def models(request: Any) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "stand-in-model", "object": "model"}]})

        self.app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                     Route("/v1/models", models)])


@pytest.mark.integration
def test_a_served_model_labels_states_through_the_gateway_and_its_invalid_turns_are_dropped(
        suite: ToolsSuite, tmp_path: Path) -> None:
    from tests.processes import GatewayProcess, upstream_config
    from tests.standin import ServerThread
    from training.teacher import ServedTeacher

    task = next(t for t in suite.tasks("train") if t.family == "recovery" and t.fault.tool == "sql_query")
    demo = asyncio.run(suite.solve(task))  # the solver's own episode: the fault, its retry, the answer
    # The policy's episode: the same first call and its failure, then an answer without retrying.
    episode = [{"role": "system", "content": suite.system_prompt}, *demo[:3],
               {"role": "assistant", "content": "The tool failed, so I cannot say."}]
    standin = StandInTeacher(suite, task)
    with ServerThread(standin.app) as upstream:
        gateway = GatewayProcess(upstream_config(upstream.url, extra="[server]\nguard_retries = 0\n"),
                                 tmp_path).start()
        try:
            async def label() -> tuple[list, Counter, ServedTeacher]:
                teacher = ServedTeacher(gateway.url, "stand-in-model")
                kinds: Counter[str] = Counter()
                try:
                    return await corrections(suite, task, episode, teacher, kinds), kinds, teacher
                finally:
                    await teacher.aclose()

            rows, kinds, teacher = asyncio.run(label())
        finally:
            gateway.stop()
    # The first state (start): the teacher's call agrees with the policy's. The second (after the failure): the
    # teacher's turn broke the tool's schema, so it was dropped and counted, not learnt.
    assert standin.requests == 2
    assert kinds == {"agreed": 1, "teacher_dropped": 1}
    assert rows == [] and teacher.dropped == 1 and teacher.failures == {"invalid_call": 1}
    # The gateway captured what the teacher was asked, like any other traffic.
    import sqlite3
    with sqlite3.connect(gateway.db) as db:
        assert db.execute("SELECT COUNT(*) FROM model_calls").fetchone()[0] == 2


@pytest.mark.integration
def test_a_served_teacher_that_answers_right_becomes_the_label(suite: ToolsSuite, tmp_path: Path) -> None:
    from tests.processes import GatewayProcess, upstream_config
    from tests.standin import ServerThread
    from training.teacher import ServedTeacher

    task = first(suite, "sql_lookup", split="train")
    demo = asyncio.run(suite.solve(task))
    episode = [{"role": "system", "content": suite.system_prompt}, *demo[:3],
               call("calculator", {"expression": f"{task.expected} * 100"}, "call_p2"), result("x", "call_p2")]
    standin = StandInTeacher(suite, task)
    with ServerThread(standin.app) as upstream:
        gateway = GatewayProcess(upstream_config(upstream.url), tmp_path).start()
        try:
            async def label() -> tuple[list, Counter]:
                teacher = ServedTeacher(gateway.url, "stand-in-model")
                kinds: Counter[str] = Counter()
                try:
                    return await corrections(suite, task, episode + [{"role": "assistant", "content": "570000"}],
                                             teacher, kinds), kinds
                finally:
                    await teacher.aclose()

            rows, kinds = asyncio.run(label())
        finally:
            gateway.stop()
    assert kinds == {"agreed": 1, "called_instead_of_answering": 1, "wrong_answer": 1}
    assert [len(p) for p, _ in rows] == [4, 6]
    assert all(suite.verify(task, turn["content"], prefix) for prefix, turn in rows)
