from typing import Any

import pytest

from gateway.config import ConfigError, ToolsSettings
from tools.context import ToolContext
from tools.executor import execute
from tools.registry import ToolRegistry, default_registry, tool
from tools.spec import ToolSpec

PARAMS = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@tool(parameters=PARAMS, timeout=2, permissions=["network"])
async def greet(arguments: dict[str, Any], context: ToolContext) -> str:
    """Say hello to someone."""
    return f"hello {arguments['name']}"


def test_decorator_builds_a_spec_from_the_function() -> None:
    assert isinstance(greet, ToolSpec)
    assert greet.name == "greet" and greet.description == "Say hello to someone."
    assert greet.timeout == 2 and greet.permissions == frozenset({"network"})


def test_decorator_needs_a_description() -> None:
    with pytest.raises(ValueError, match="description"):
        @tool(parameters=PARAMS)
        async def silent(arguments: dict[str, Any], context: ToolContext) -> str:
            return ""


async def test_registry_decorator_registers_and_runs() -> None:
    registry = ToolRegistry()

    @registry.tool(name="shout", description="Upper-case a name.", parameters=PARAMS)
    async def _shout(arguments: dict[str, Any], context: ToolContext) -> str:
        return arguments["name"].upper()

    assert registry.names() == ["shout"] and "shout" in registry and len(registry) == 1
    outcome = await execute(registry["shout"], {"name": "ada"}, ToolContext())
    assert (outcome.status, outcome.output) == ("ok", "ADA")


def test_duplicate_names_are_an_error() -> None:
    registry = ToolRegistry([greet])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(greet)


def test_get_subset_and_openai_tools() -> None:
    registry = default_registry(ToolsSettings())
    assert registry.names() == ["calculator", "sql_query", "write_file", "http_get", "browse", "send_message"]
    assert registry.get("nope") is None
    with pytest.raises(KeyError, match="no tool named 'nope'"):
        registry["nope"]
    narrow = registry.subset(["http_get", "calculator"])
    assert narrow.names() == ["http_get", "calculator"]
    assert [t["function"]["name"] for t in registry.openai_tools(["browse"])] == ["browse"]
    assert len(registry.openai_tools()) == 6
    with pytest.raises(KeyError, match="unknown tools"):
        registry.subset(["calculator", "rm_rf"])


def test_default_registry_follows_settings() -> None:
    registry = default_registry(ToolsSettings(write_requires_approval=False, http_timeout=3, output_cap=500))
    assert registry["write_file"].requires_approval is False
    assert registry["http_get"].timeout == 3 and registry["http_get"].output_cap == 500
    assert default_registry(ToolsSettings())["write_file"].requires_approval is True
    assert registry["write_file"].permissions == frozenset({"filesystem:write"})
    assert registry["sql_query"].permissions == frozenset({"database:read"})
    assert "network" in registry["browse"].permissions
    assert registry["send_message"].requires_approval is True  # whatever the settings say


def test_any_tool_can_be_made_to_wait_for_approval() -> None:
    registry = default_registry(ToolsSettings(require_approval=["http_get", "sql_query"]))
    assert {s.name for s in registry if s.requires_approval} == {"write_file", "http_get", "sql_query", "send_message"}
    with pytest.raises(ConfigError, match="require_approval names unknown tools: nope"):
        default_registry(ToolsSettings(require_approval=["nope"]))
