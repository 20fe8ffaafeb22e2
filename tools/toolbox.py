"""The tools one agent run may use, bound to the shared context: the agent loop's ``AllowedTools``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tools.context import ToolContext
from tools.executor import ToolOutcome, execute
from tools.registry import ToolRegistry
from tools.spec import ToolSpec


class Toolbox:
    """A profile's allowed tools (a subset of the registry) and the context they run with."""

    def __init__(self, registry: ToolRegistry, context: ToolContext, names: Iterable[str] | None = None) -> None:
        self.registry = registry if names is None else registry.subset(names)
        self.context = context

    def get(self, name: str) -> ToolSpec | None:
        return self.registry.get(name)

    def schemas(self) -> dict[str, dict[str, Any] | None]:
        """Each allowed tool's parameter schema, by name."""
        return {spec.name: dict(spec.parameters) for spec in self.registry}

    def openai_tools(self) -> list[dict[str, Any]]:
        return self.registry.openai_tools()

    async def execute(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Runs an allowed tool; an unknown name is an error outcome, never an exception."""
        spec = self.registry.get(name)
        if spec is None:
            return ToolOutcome("error", f"Tool {name} failed: no such tool", 0.0)
        return await execute(spec, arguments, self.context)
