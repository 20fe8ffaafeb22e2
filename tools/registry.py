"""The tools a gateway knows, by name; a decorator for defining your own; the built-in set."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from tools.builtin import browse, calculator, http_get, send_message, sql_query, write_file
from tools.settings import ConfigError, ToolsSettings
from tools.spec import OUTPUT_CAP, ToolFunction, ToolSpec


def tool(
    *,
    parameters: Mapping[str, Any],
    name: str | None = None,
    description: str | None = None,
    timeout: float = 30.0,
    output_cap: int = OUTPUT_CAP,
    permissions: Iterable[str] = (),
    requires_approval: bool = False,
) -> Callable[[ToolFunction], ToolSpec]:
    """Turns an ``async def f(arguments, context)`` into a ``ToolSpec``.

    The name defaults to the function's, the description to its docstring (what the model reads).
    """

    def wrap(func: ToolFunction) -> ToolSpec:
        text = description if description is not None else (func.__doc__ or "").strip()
        if not text:
            raise ValueError(f"tool {name or func.__name__}: give a description or a docstring; the model reads it")
        return ToolSpec(
            name=name or func.__name__,
            description=text,
            parameters=parameters,
            run=func,
            timeout=timeout,
            output_cap=output_cap,
            permissions=frozenset(permissions),
            requires_approval=requires_approval,
        )

    return wrap


class ToolRegistry:
    """Tools by name, in the order they were registered. Names are unique."""

    def __init__(self, specs: Iterable[ToolSpec] = ()) -> None:
        self._specs: dict[str, ToolSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: ToolSpec) -> ToolSpec:
        if spec.name in self._specs:
            raise ValueError(f"a tool named {spec.name!r} is already registered")
        self._specs[spec.name] = spec
        return spec

    def tool(self, **options: Any) -> Callable[[ToolFunction], ToolSpec]:
        """``tool(...)`` that also registers the spec here."""

        def wrap(func: ToolFunction) -> ToolSpec:
            return self.register(tool(**options)(func))

        return wrap

    def get(self, name: str) -> ToolSpec | None:
        return self._specs.get(name)

    def __getitem__(self, name: str) -> ToolSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"no tool named {name!r} (known: {', '.join(self._specs) or 'none'})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return list(self._specs)

    def subset(self, names: Iterable[str]) -> ToolRegistry:
        """A registry of only these tools (a profile's allowed set); unknown names are an error."""
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in self._specs]
        if unknown:
            raise KeyError(f"unknown tools {unknown} (known: {', '.join(self._specs) or 'none'})")
        return ToolRegistry(self._specs[n] for n in wanted)

    def requiring_approval(self, names: Iterable[str]) -> ToolRegistry:
        """The same tools, with these also waiting for a person's approval; unknown names are an error."""
        marked = set(names)
        unknown = sorted(marked - set(self._specs))
        if unknown:
            raise ConfigError(f"[tools] require_approval names unknown tools: {', '.join(unknown)} "
                              f"(known: {', '.join(self._specs)})")
        return ToolRegistry(dataclasses.replace(spec, requires_approval=True) if spec.name in marked else spec
                            for spec in self)

    def openai_tools(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The chat request ``tools`` list for these names (all tools when none are given)."""
        specs = self if names is None else self.subset(names)
        return [spec.openai_tool() for spec in specs]


def default_registry(settings: ToolsSettings | None = None) -> ToolRegistry:
    """The built-in tools, configured from ``[tools]``."""
    settings = settings or ToolsSettings()
    modules = (calculator, sql_query, write_file, http_get, browse, send_message)
    registry = ToolRegistry(module.build(settings) for module in modules)
    return registry.requiring_approval(settings.require_approval)
