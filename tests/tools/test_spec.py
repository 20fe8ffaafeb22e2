from typing import Any

import pytest
from jsonschema.exceptions import SchemaError

from tools.context import ToolContext
from tools.spec import ToolSpec

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


async def _noop(arguments: dict[str, Any], context: ToolContext) -> str:
    return "ok"


def test_openai_tool_shape() -> None:
    spec = ToolSpec("weather", "Current weather for a city.", SCHEMA, _noop)
    assert spec.openai_tool() == {
        "type": "function",
        "function": {"name": "weather", "description": "Current weather for a city.", "parameters": SCHEMA},
    }


def test_defaults_and_permissions_are_frozen() -> None:
    spec = ToolSpec("t", "d", SCHEMA, _noop, permissions={"network"})  # type: ignore[arg-type]
    assert spec.permissions == frozenset({"network"}) and isinstance(spec.permissions, frozenset)
    assert spec.timeout == 30.0 and spec.output_cap == 20_000 and spec.requires_approval is False
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "dots.not.allowed"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="tool name"):
        ToolSpec(name, "d", SCHEMA, _noop)


def test_bad_limits_and_schemas_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        ToolSpec("t", "d", SCHEMA, _noop, timeout=0)
    with pytest.raises(ValueError, match="output_cap"):
        ToolSpec("t", "d", SCHEMA, _noop, output_cap=0)
    with pytest.raises(SchemaError):
        ToolSpec("t", "d", {"type": "no-such-type"}, _noop)
