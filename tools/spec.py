"""What a tool is: its spec (name, schema, limits, permissions) and the error a tool raises on purpose."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator

from tools.settings import ToolsSettings

# A tool's result is cut past this many characters unless its spec says otherwise: [tools] output_cap's default,
# which the built-in tools take from the settings themselves.
OUTPUT_CAP: int = ToolsSettings.default_of("output_cap")

if TYPE_CHECKING:
    from tools.context import ToolContext

# What OpenAI accepts as a function name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

ToolFunction = Callable[[dict[str, Any], "ToolContext"], Awaitable[Any]]


class ToolError(Exception):
    """A failure the tool explains itself; its message goes to the model as it is."""


@dataclass(frozen=True, eq=False)
class ToolSpec:
    """One tool: what the model sees (name, description, parameters) and how the harness runs it.

    ``run`` receives the validated arguments and the shared ``ToolContext`` and returns a string or
    anything ``json.dumps`` accepts. ``permissions`` name what the tool touches ("network",
    "filesystem:write", "database:read") so a profile can reason about them; ``requires_approval``
    tells the agent loop to hold the call until a person allows it.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    run: ToolFunction = field(repr=False)
    timeout: float = 30.0
    output_cap: int = OUTPUT_CAP
    permissions: frozenset[str] = frozenset()
    requires_approval: bool = False
    validator: Draft202012Validator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if self.timeout <= 0:
            raise ValueError(f"tool {self.name}: timeout must be positive, got {self.timeout}")
        if self.output_cap <= 0:
            raise ValueError(f"tool {self.name}: output_cap must be positive, got {self.output_cap}")
        # A broken schema is the tool author's bug: fail at definition, not at the model's first call.
        Draft202012Validator.check_schema(self.parameters)
        object.__setattr__(self, "permissions", frozenset(self.permissions))
        object.__setattr__(self, "validator", Draft202012Validator(self.parameters))

    def openai_tool(self) -> dict[str, Any]:
        """The entry for a chat request's ``tools`` list."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }
