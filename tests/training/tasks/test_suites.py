"""The task suites: fixed splits, no test material in train/validation, solvable tasks, faults, the verifier."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

import training.tasks as tasks_pkg
from gateway.agent.limits import Limits
from gateway.agent.loop import AgentLoop, Profile, RunState, StepRecord
from gateway.agent.validation import check_call
from tests.scripted import ScriptedBackend
from tools.executor import execute
from tools.registry import tool
from training.tasks import SPLITS, SUITES, Fault, Task, get_suite
from training.tasks.base import check_final, fault_outcome, numbers_in
from training.tasks.domains import DOMAINS, UNSEEN_DOMAINS
from training.tasks.tools_suite import (
    EMPLOYEES,
    SIZES,
    TEST_EMPLOYEES,
    TEST_FAMILIES,
    TEST_PRODUCTS,
    TEST_TOOL,
    VALIDATION_EMPLOYEES,
    VALIDATION_PRODUCTS,
    VALIDATION_UNKNOWN_PEOPLE,
    VALIDATION_UNKNOWN_PRODUCTS,
    ToolsSuite,
    held_out_fragments,
)

DOCUMENTED_SIZES = {"train": 424, "validation": 51, "test": 71}


def _seen(suite: ToolsSuite) -> list[Task]:
    return suite.tasks("train") + suite.tasks("validation")


def _calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]


# -- the registry of suites -----------------------------------------------------------------------


def test_get_suite_knows_tools_and_names_the_known_ones(tmp_path: Path) -> None:
    assert "tools" in SUITES
    assert isinstance(get_suite("tools", data_dir=tmp_path), ToolsSuite)
    with pytest.raises(ValueError, match="unknown task suite 'nope'.*tools"):
        get_suite("nope")


# -- splits ---------------------------------------------------------------------------------------


def test_splits_are_deterministic_sized_and_well_formed(suite: ToolsSuite, tmp_path: Path) -> None:
    other = ToolsSuite(tmp_path)
    registry = suite.registry()
    ids = set()
    for split in SPLITS:
        tasks = suite.tasks(split)
        assert tasks == suite.tasks(split) == other.tasks(split)
        assert len(tasks) == DOCUMENTED_SIZES[split] == sum(SIZES[split].values())
        assert {f: sum(t.family == f for t in tasks) for f in SIZES[split]} == SIZES[split]
        for t in tasks:
            assert t.split == split and t.suite == "tools"
            assert re.fullmatch(rf"tools/{split}/[a-z-]+-\d{{3}}", t.id)
            assert t.tools and all(name in registry for name in t.tools)
            assert (t.expected is None) == (t.family in ("cannot", "service_decline"))
            assert (t.fault is not None) == (t.family in ("recovery", "service_recovery"))
            if t.fault is not None:
                assert t.fault.tool in t.tools and t.fault.call == 1
            ids.add(t.id)
    every = suite.all_tasks()
    assert len(ids) == len(every)
    assert len({t.prompt for t in every}) == len(every)
    with pytest.raises(ValueError, match="unknown split"):
        suite.tasks("dev")


def test_recovery_covers_every_fault_kind_and_tool(suite: ToolsSuite) -> None:
    for split in SPLITS:
        faults = [t.fault for t in suite.tasks(split) if t.fault is not None]
        assert {f.kind for f in faults} == {"timeout", "empty", "error"}
    train = [t for t in suite.tasks("train") if t.fault is not None]
    assert {(t.fault.tool, t.fault.kind) for t in train if t.family == "recovery"} == {
        (tool_, kind) for tool_ in ("sql_query", "calculator") for kind in ("timeout", "empty", "error")}
    service = [t.fault for t in train if t.family == "service_recovery"]
    assert {f.kind for f in service} == {"timeout", "empty", "error"}
    assert len({f.tool for f in service}) >= 6  # the faults hit generated tools of several domains


# -- leakage --------------------------------------------------------------------------------------


def test_markers_name_the_test_only_tool_families_and_prompts(suite: ToolsSuite) -> None:
    markers = tasks_pkg.test_only_markers(suite)
    assert markers["tools"] == sorted([TEST_TOOL, *(t for d in DOMAINS if d.name in UNSEEN_DOMAINS for t in d.tools)])
    assert len(markers["tools"]) >= 4  # the unit converter and at least three generated tools
    assert markers["families"] == sorted(TEST_FAMILIES)
    assert markers["prompts"] == [t.prompt for t in suite.tasks("test")]
    # Every test prompt is written in a test-only phrasing.
    for prompt in markers["prompts"]:
        assert any(p.lower() in prompt.lower() for p in markers["phrasings"]), prompt


def test_no_test_material_in_train_or_validation(suite: ToolsSuite, demos: dict[str, list[dict[str, Any]]]) -> None:
    markers = tasks_pkg.test_only_markers(suite)
    seen = _seen(suite)
    seen_text = [t.prompt for t in seen] + [json.dumps(demos[t.id]) for t in seen] + [suite.system_prompt]
    joined = "\n".join(seen_text).lower()
    for prompt in markers["prompts"]:
        assert prompt.lower() not in joined, prompt
    for phrase in markers["phrasings"]:
        assert phrase.lower() not in joined, phrase
    for name in markers["tools"]:
        assert name not in joined
        assert all(name not in t.tools for t in seen)
    assert not {t.family for t in seen} & set(markers["families"])
    # Test tasks ask about employees and products no train or validation prompt mentions.
    for entity in (*TEST_EMPLOYEES, *TEST_PRODUCTS):
        assert not any(re.search(rf"\b{entity}\b", t.prompt) for t in seen), entity
    assert all(name in registry for registry in [suite.registry()] for name in markers["tools"])


def test_validation_has_its_own_phrasings_and_entities(suite: ToolsSuite) -> None:
    train, validation, test = (suite.tasks(split) for split in ("train", "validation", "test"))
    fragments = held_out_fragments("validation")
    for task in validation:  # every validation prompt in a validation-only phrasing
        assert any(f.lower() in task.prompt.lower() for f in fragments), task.prompt
    for task in (*train, *test):
        assert not any(f.lower() in task.prompt.lower() for f in fragments), task.prompt
    held = (*VALIDATION_EMPLOYEES, *VALIDATION_PRODUCTS, *VALIDATION_UNKNOWN_PEOPLE, *VALIDATION_UNKNOWN_PRODUCTS)
    for entity in held:
        assert not any(re.search(rf"\b{entity}\b", t.prompt) for t in (*train, *test)), entity
    asked = " ".join(t.prompt for t in validation)
    assert sum(entity in asked for entity in held) >= 4  # validation asks about its own entities
    assert not set(held_out_fragments("validation")) & set(held_out_fragments("test"))


def test_test_split_holds_the_held_out_family_and_tool(suite: ToolsSuite) -> None:
    test = suite.tasks("test")
    assert {t.family for t in test} >= set(TEST_FAMILIES) | {"recovery", "cannot"}
    uses_tool = [t for t in test if TEST_TOOL in t.tools]
    assert uses_tool and all(t.family == "unit_conversion" for t in uses_tool)


# -- demonstrations -------------------------------------------------------------------------------


def test_every_demonstration_verifies_and_calls_tools_validly(suite: ToolsSuite,
                                                               demos: dict[str, list[dict[str, Any]]]) -> None:
    for t in suite.all_tasks():
        messages = demos[t.id]
        assert messages[0] == {"role": "user", "content": t.prompt}
        final = messages[-1]
        assert final["role"] == "assistant" and not final.get("tool_calls") and final["content"]
        assert suite.verify(t, final["content"], messages), (t, messages)
        schemas = suite.toolbox(t).schemas()
        i, made = 1, 0
        while i < len(messages) - 1:  # each turn's calls, then their results in the same order
            m = messages[i]
            # Two independent look-ups are made together in the first turn; every other turn makes one call.
            together = 2 if t.family == "service_parallel" and i == 1 else 1
            assert m["role"] == "assistant" and m["content"] == "" and len(m["tool_calls"]) == together
            for j, c in enumerate(m["tool_calls"], start=1):
                made += 1
                assert c["type"] == "function" and c["id"] == f"call_{made}"
                checked = check_call(c["id"], c["function"]["name"], c["function"]["arguments"], schemas)
                assert checked.valid and not checked.repaired, (t.id, checked.error)
                assert messages[i + j] == {"role": "tool", "tool_call_id": c["id"],
                                           "content": messages[i + j]["content"]}
            i += 1 + together
        calls = _calls(messages)
        if t.family == "no_tool":
            assert not calls
        elif t.family == "cannot":
            assert len(calls) <= 1
        elif t.family == "recovery":
            assert len(calls) >= 2
        else:
            assert calls
        if t.family == "unit_conversion":
            assert calls[0]["function"]["name"] == TEST_TOOL


def test_recovery_demonstrations_show_the_fault_then_a_retry(suite: ToolsSuite,
                                                              demos: dict[str, list[dict[str, Any]]]) -> None:
    for t in suite.all_tasks():
        if t.fault is None:
            continue
        messages = demos[t.id]
        spec = suite.registry()[t.fault.tool]
        expected_output = fault_outcome(spec, t.fault.kind).output
        at = next(i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")
                  and m["tool_calls"][0]["function"]["name"] == t.fault.tool)
        assert messages[at + 1]["content"] == expected_output
        retry = messages[at + 2]["tool_calls"][0]["function"]
        assert retry["name"] == t.fault.tool
        # A retry of the built-in tools is written a little differently (valid even were the same call twice in a
        # row refused); a generated tool has no second way to write its call, and the agent loop lets a failed
        # call be repeated as it was (the replay test below runs such a retry through it).
        if t.family != "service_recovery":
            first = json.loads(messages[at]["tool_calls"][0]["function"]["arguments"])
            assert json.loads(retry["arguments"]) != first
        assert messages[at + 3]["content"] != expected_output and messages[at + 3]["content"].strip()


async def test_solve_rejects_a_task_of_another_suite(suite: ToolsSuite) -> None:
    stranger = Task(id="other/train/x-000", suite="other", family="calculator", split="train", prompt="1+1?",
                    tools=("calculator",), expected=2)
    with pytest.raises(KeyError):
        await suite.solve(stranger)


# -- faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["timeout", "empty", "error"])
async def test_fault_fires_on_the_configured_call_only(suite: ToolsSuite, kind: str) -> None:
    task = Task(id="tools/x/calc-000", suite="tools", family="recovery", split="train", prompt="2+3?",
                tools=("calculator", "sql_query"), expected=5, fault=Fault("calculator", kind, call=2))  # type: ignore[arg-type]
    box = suite.toolbox(task)
    first = await box.execute("calculator", {"expression": "2 + 3"})
    assert (first.status, first.output) == ("ok", "5")
    other = await box.execute("sql_query", {"query": "SELECT count(*) FROM products"})
    assert other.status == "ok"
    faulted = await box.execute("calculator", {"expression": "2 + 3"})
    after = await box.execute("calculator", {"expression": "2 + 3"})
    assert (after.status, after.output) == ("ok", "5")
    if kind == "timeout":
        assert (faulted.status, faulted.output) == ("timeout", "Tool calculator timed out after 5s")
    elif kind == "empty":
        assert (faulted.status, faulted.output) == ("ok", "")
    else:
        assert faulted.status == "error"
        assert faulted.output.startswith("Tool calculator failed: ") and len(faulted.output) > 30
    assert [injected for *_, injected in box.executed] == [False, False, True, False]
    # A fresh toolbox is a fresh episode: its count starts again.
    fresh = suite.toolbox(task)
    assert (await fresh.execute("calculator", {"expression": "1 + 1"})).output == "2"


async def test_fault_texts_match_the_executors_own() -> None:
    @tool(parameters={"type": "object"}, timeout=0.05)
    async def slow(arguments: dict[str, Any], context: Any) -> str:
        """Never answers in time."""
        await asyncio.sleep(1)
        return "late"

    @tool(parameters={"type": "object"})
    async def broken(arguments: dict[str, Any], context: Any) -> str:
        """Always fails."""
        raise RuntimeError("disk on fire")

    real_timeout = await execute(slow, {}, None)  # type: ignore[arg-type]
    assert (real_timeout.status, real_timeout.output) == (fault_outcome(slow, "timeout").status,
                                                          fault_outcome(slow, "timeout").output)
    real_error = await execute(broken, {}, None)  # type: ignore[arg-type]
    injected = fault_outcome(broken, "error")
    assert injected.status == real_error.status == "error"
    assert re.fullmatch(r"Tool broken failed: \w+: .+", injected.output)
    assert re.fullmatch(r"Tool broken failed: \w+: .+", real_error.output)


def test_fault_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError):
        Fault("calculator", "flaky")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fault("calculator", "error", call=0)


# -- the verifier ---------------------------------------------------------------------------------


def _first(suite: ToolsSuite, family: str, split: str = "train", kind: type | None = None) -> Task:
    return next(t for t in suite.tasks(split) if t.family == family
                and (kind is None or isinstance(t.expected, kind)))


def test_verify_numbers(suite: ToolsSuite) -> None:
    task = _first(suite, "calculator")
    n = task.expected
    assert suite.verify(task, f"The answer is {n}.", [])
    assert suite.verify(task, f"The answer is {n + 0.004}.", [])
    assert not suite.verify(task, f"The answer is {n + 1}.", [])
    assert not suite.verify(task, "The answer is 3.", [])
    assert not suite.verify(task, "", [])
    assert not suite.verify(task, "   ", [])
    assert not suite.verify(task, None, [])
    assert not suite.verify(task, f"I cannot compute that, maybe {n}.", [])
    assert not suite.verify(task, "I'm unable to answer that.", [])


def test_verify_number_parsing() -> None:
    assert numbers_in("It is 5,200 or -3.5 and x2, 7.") == [5200.0, -3.5, 7.0]
    assert numbers_in("5200-4100=1100") == [5200.0, 4100.0, 1100.0]
    assert check_final(1234567.0, "About 1,234,567.", "")
    assert check_final(1e9, "It is 1000000001.", "")  # within a relative 1e-6
    assert not check_final(1e9, "It is 1000002000.", "")


def test_verify_strings(suite: ToolsSuite) -> None:
    task = _first(suite, "sql_lookup", kind=str)
    assert suite.verify(task, f"They work in {task.expected.upper()}.", [])
    assert not suite.verify(task, "They work in Atlantis.", [])


def test_verify_several_values_and_direct_answers(suite: ToolsSuite) -> None:
    assert check_final((120, 340), "The fare of A is 120, and of B 340.")
    assert check_final((120, 340), "B costs 340 and A 120.")
    assert not check_final((120, 340), "The fare of A is 120.")
    assert not check_final((1, 2), "It is 1, 2, 3, 4 or 5.")  # a list of guesses
    terminals = ("north", "south", "central")
    assert check_final(("south", "north"), "A leaves from south, B from north.", alternatives=terminals)
    assert not check_final(("south", "south"), "South, or maybe central.", alternatives=terminals)
    task = next(t for t in suite.tasks("train") if t.family == "no_tool")
    final = f"That would be {task.expected.word}."
    answered = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": final}]
    assert suite.verify(task, final, answered)
    assert not suite.verify(task, "The answer is 42.", answered)  # answered without a call, but wrongly
    assert not suite.verify(task, "I cannot answer that.", answered)
    legs = next(t for t in suite.draw("test", 100, seed=0, min_direct=15) if "spider" in t.prompt)
    assert legs.expected.word == "eight" and suite.verify(legs, "A spider has 8 legs.", answered[:1])
    called = [answered[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": task.tools[0], "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "Invalid call"}, answered[1]]
    assert not suite.verify(task, final, called)  # any call, an invalid one too, fails


def test_verify_cannot(suite: ToolsSuite) -> None:
    task = _first(suite, "cannot")
    for refusal in ("I cannot answer that.", "I can\u2019t tell.", "I am unable to find them.",
                    "I do not have that information.", "That is not available."):
        assert suite.verify(task, refusal, []), refusal
    assert not suite.verify(task, "Their salary is 4000.", [])
    assert not suite.verify(task, "I cannot be sure, but it is about 4000.", [])
    assert not suite.verify(task, "", [])
    assert not suite.verify(task, None, [])
    numbered = Task(id="t", suite="tools", family="cannot", split="train", prompt="What is 7 plus the age of Bo?",
                    tools=("calculator",), expected=None)
    assert suite.verify(numbered, "I cannot: I do not know Bo's age, so 7 plus it is unknown.", [])


# -- through the agent loop -----------------------------------------------------------------------


class NoRecorder:
    async def step(self, state: RunState, record: StepRecord) -> None:
        pass


def _pick(suite: ToolsSuite) -> list[Task]:
    """One task of each family and split, plus one recovery task per fault kind."""
    picked: dict[tuple[str, str], Task] = {}
    for t in suite.all_tasks():
        key = (t.split, t.family, t.fault.kind if t.fault else None)
        picked.setdefault(key, t)
    return list(picked.values())


async def test_demonstrations_replay_through_the_agent_loop(suite: ToolsSuite) -> None:
    for task in _pick(suite):
        demo = await suite.solve(task)
        script = [m for m in demo if m["role"] == "assistant"]
        backend = ScriptedBackend(script)
        profile = Profile(name="tools", model="scripted-model", system_prompt=suite.system_prompt,
                          tools=list(task.tools), limits=Limits(max_steps=8))
        state = RunState(run_id=f"run-{task.id}", profile=profile.name, messages=[
            {"role": "system", "content": suite.system_prompt}, {"role": "user", "content": task.prompt}])
        loop = AgentLoop(profile=profile, backend=backend, toolbox=suite.toolbox(task), recorder=NoRecorder(),
                         state=state)
        await loop.run()
        assert state.status == "completed", (task.id, state.termination_reason, state.messages)
        assert state.invalid_tool_calls == 0
        assert suite.verify(task, state.final, state.messages), (task.id, state.messages)
        observed = [m["content"] for m in state.messages if m["role"] == "tool"]
        assert observed == [m["content"] for m in demo if m["role"] == "tool"], task.id
        offered = {t["function"]["name"] for t in backend.requests[0]["tools"]}
        assert offered == set(task.tools)


def test_employee_table_is_what_tasks_assume(suite: ToolsSuite) -> None:
    import sqlite3

    path = suite.ensure_database()
    rows = sqlite3.connect(path).execute("SELECT name, department, salary, city FROM employees").fetchall()
    assert sorted(rows) == sorted(EMPLOYEES)
    # Written once: a second call leaves the file alone.
    before = path.stat().st_mtime_ns
    suite.context()
    assert path.stat().st_mtime_ns == before
