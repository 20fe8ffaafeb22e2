import asyncio
import json
from typing import Any

import pytest

from tools.context import ToolContext
from tools.executor import execute, validate_arguments
from tools.registry import tool
from tools.spec import ToolError, ToolSpec

ANY_OBJECT = {"type": "object"}


def make(result: Any = None, *, error: Exception | None = None, delay: float = 0.0, **options: Any) -> ToolSpec:
    async def run(arguments: dict[str, Any], context: ToolContext) -> Any:
        await asyncio.sleep(delay)
        if error is not None:
            raise error
        return result

    return ToolSpec("probe", "A test tool.", ANY_OBJECT, run, **options)


@pytest.fixture
def context() -> ToolContext:
    return ToolContext()


async def test_ok_string(context: ToolContext) -> None:
    outcome = await execute(make("fine"), {}, context)
    assert (outcome.status, outcome.output, outcome.truncated) == ("ok", "fine", False)
    assert outcome.duration_ms >= 0


async def test_non_string_results_are_json(context: ToolContext) -> None:
    outcome = await execute(make({"a": [1, 2.5, None, "é"]}), {}, context)
    assert json.loads(outcome.output) == {"a": [1, 2.5, None, "é"]}
    assert "é" in outcome.output  # readable, not \\u-escaped


async def test_unserialisable_result_is_an_error(context: ToolContext) -> None:
    outcome = await execute(make({1, 2}), {}, context)
    assert outcome.status == "error"
    assert outcome.output.startswith("Tool probe failed: the tool returned a result that is not JSON-serialisable")


async def test_timeout(context: ToolContext) -> None:
    outcome = await execute(make("late", delay=5, timeout=0.05), {}, context)
    assert outcome.status == "timeout"
    assert outcome.output == "Tool probe timed out after 0.05s"
    assert outcome.duration_ms < 2000


async def test_tools_own_timeout_error_is_not_reported_as_ours(context: ToolContext) -> None:
    outcome = await execute(make(error=TimeoutError("upstream took too long"), timeout=10), {}, context)
    assert (outcome.status, outcome.output) == ("error", "Tool probe failed: upstream took too long")


async def test_exceptions_become_observations(context: ToolContext) -> None:
    outcome = await execute(make(error=ToolError("no such city")), {}, context)
    assert (outcome.status, outcome.output) == ("error", "Tool probe failed: no such city")
    outcome = await execute(make(error=KeyError("x")), {}, context)
    assert (outcome.status, outcome.output) == ("error", "Tool probe failed: KeyError: 'x'")


async def test_output_cap_marks_truncation(context: ToolContext) -> None:
    outcome = await execute(make("x" * 250, output_cap=100), {}, context)
    assert outcome.truncated and outcome.status == "ok"
    assert outcome.output == "x" * 100 + "\n[truncated 150 characters]"
    # The cap applies to failures too: a huge error message cannot flood the context.
    outcome = await execute(make(error=ToolError("y" * 500), output_cap=50), {}, context)
    assert outcome.status == "error" and outcome.output.endswith("[truncated 469 characters]")


async def test_cancellation_propagates(context: ToolContext) -> None:
    task = asyncio.create_task(execute(make("late", delay=5), {}, context))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@tool(parameters={
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "count": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city"],
    "additionalProperties": False,
})
async def weather(arguments: dict[str, Any], context: ToolContext) -> str:
    """Weather for a city."""
    return "sunny"


def test_validate_arguments_names_path_and_problem() -> None:
    assert validate_arguments(weather, {"city": "Oslo", "count": 2, "tags": ["a"], "unit": "c"}) == []
    assert validate_arguments(weather, {}) == ["arguments.city: 'city' is a required property"]
    assert validate_arguments(weather, {"city": "Oslo", "count": "x"}) == [
        "arguments.count: 'x' is not of type 'integer'"]
    assert validate_arguments(weather, {"city": "Oslo", "tags": ["a", 3]}) == [
        "arguments.tags[1]: 3 is not of type 'string'"]
    assert validate_arguments(weather, {"city": "Oslo", "unit": "k"}) == [
        "arguments.unit: 'k' is not one of ['c', 'f']"]
    assert validate_arguments(weather, {"city": "Oslo", "extra": 1}) == [
        "arguments: Additional properties are not allowed ('extra' was unexpected)"]
    assert validate_arguments(weather, []) == ["arguments: [] is not of type 'object'"]


def test_validate_arguments_reports_every_problem() -> None:
    problems = validate_arguments(weather, {"count": 0})
    assert problems == [
        "arguments.city: 'city' is a required property",
        "arguments.count: 0 is less than the minimum of 1",
    ]
