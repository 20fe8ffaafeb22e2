"""The client's tools as chat-completions functions, and the backend's calls mapped back to them.

``function`` tools keep their names; ``namespace`` tools (Codex's MCP bundles) are flattened into
functions named ``{namespace}__{name}`` (``{namespace}{name}`` when the namespace already ends in
``__``, as Codex's ``mcp__server__`` ones do); ``custom`` (freeform) tools such as Codex's
``apply_patch`` become functions taking one string argument ``input``. Built-in tools (``web_search``,
``file_search``, ``local_shell``, ``mcp``, ``tool_search``, anything unknown) cannot run on a chat
backend: they are left out and listed in ``ToolMap.dropped``. A ``ToolMap`` remembers what each
function sent to the backend stands for, so calls map back: a namespaced call comes back as a
``function_call`` with the tool's own ``name`` and a ``namespace`` field (as OpenAI sends them), a
custom tool's call as a ``custom_tool_call`` carrying ``input``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

_NAME_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolEntry:
    """What one function sent to the backend stands for.

    ``kind``: ``"function"`` (a plain function tool), ``"namespace"`` (a function inside a namespace tool)
    or ``"custom"`` (a freeform tool, its ``namespace`` set when it came inside one).
    """

    kind: str
    name: str
    namespace: str | None = None


def flat_name(name: str, namespace: str | None = None) -> str:
    """The function name a (namespaced) tool gets on the backend, before de-duplication."""
    if namespace:
        name = f"{namespace}{'' if namespace.endswith('__') else '__'}{name}"
    name = _NAME_BAD_CHARS.sub("_", name) or "tool"
    if len(name) > 64:
        name = f"{name[:55]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


class ToolMap:
    """How the client's tools were presented to the chat backend, so that calls map back.

    ``entries``: backend function name -> ``ToolEntry``. ``dropped``: the tools the backend cannot run
    (built-ins such as ``{"type": "web_search"}``), as the client sent them, in order.
    ``chat_tools``: the chat-completions ``tools`` list made from the rest.
    """

    def __init__(self) -> None:
        self.entries: dict[str, ToolEntry] = {}
        self.dropped: list[dict[str, Any]] = []
        self.chat_tools: list[dict[str, Any]] = []
        self._by_origin: dict[tuple[str | None, str], str] = {}

    @classmethod
    def from_tools(cls, tools: list[Any] | None) -> ToolMap:
        """The map for a Responses ``tools`` list (rebuilding it later gives the same names)."""
        tool_map = cls()
        tool_map.add_tools(tools)
        return tool_map

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, backend_name: object) -> bool:
        return backend_name in self.entries

    def get(self, backend_name: str) -> ToolEntry | None:
        return self.entries.get(backend_name)

    def entry_for(self, backend_name: str) -> ToolEntry:
        """The entry of a name the model called; a name no tool has (a hallucination) stays a function."""
        return self.entries.get(backend_name) or ToolEntry("function", backend_name)

    def find(self, name: str | None, namespace: str | None = None) -> str | None:
        """The backend name of a client-side tool (its own name and namespace), or ``None``."""
        if not isinstance(name, str) or not name:
            return None
        found = self._by_origin.get((namespace or None, name))
        if found:
            return found
        if not namespace:
            if name in self.entries:
                return name
            matches = [b for b, e in self.entries.items() if e.name == name]
            if len(matches) == 1:
                return matches[0]
        return None

    def backend_name(self, name: str, namespace: str | None = None) -> str:
        """As ``find``, falling back to the flattening rule for tools this request no longer has."""
        return self.find(name, namespace) or flat_name(name, namespace)

    # building

    def add_tools(self, tools: list[Any] | None) -> None:
        for tool in tools or ():
            if not isinstance(tool, dict):
                continue
            kind = tool.get("type")
            if kind == "function":
                self._add_function(tool, None)
            elif kind == "custom":
                self._add_custom(tool, None)
            elif kind == "namespace":
                namespace = tool.get("name") if isinstance(tool.get("name"), str) else ""
                for inner in tool.get("tools") or ():
                    inner_kind = inner.get("type") if isinstance(inner, dict) else None
                    if inner_kind == "function":
                        self._add_function(inner, namespace or None)
                    elif inner_kind == "custom":
                        self._add_custom(inner, namespace or None)
                    elif isinstance(inner, dict):
                        self.dropped.append({**inner, "namespace": namespace})
            else:
                self.dropped.append(tool)

    def _allocate(self, entry: ToolEntry) -> str:
        base = flat_name(entry.name, entry.namespace)
        name, n = base, 1
        while name in self.entries:
            n += 1
            suffix = f"_{n}"
            name = base[: 64 - len(suffix)] + suffix
        self.entries[name] = entry
        self._by_origin.setdefault((entry.namespace, entry.name), name)
        return name

    def _add_function(self, tool: dict[str, Any], namespace: str | None) -> None:
        original = tool.get("name")
        if not isinstance(original, str) or not original:
            return
        name = self._allocate(ToolEntry("namespace" if namespace else "function", original, namespace))
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str) and tool["description"]:
            function["description"] = tool["description"]
        parameters = tool.get("parameters")
        function["parameters"] = parameters if isinstance(parameters, dict) else dict(_EMPTY_PARAMETERS)
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        self.chat_tools.append({"type": "function", "function": function})

    def _add_custom(self, tool: dict[str, Any], namespace: str | None) -> None:
        original = tool.get("name")
        if not isinstance(original, str) or not original:
            return
        name = self._allocate(ToolEntry("custom", original, namespace))
        self.chat_tools.append({"type": "function", "function": {
            "name": name,
            "description": _custom_description(tool),
            "parameters": {"type": "object",
                           "properties": {"input": {"type": "string",
                                                    "description": "The complete free-form input of the tool."}},
                           "required": ["input"], "additionalProperties": False},
        }})


def _custom_description(tool: dict[str, Any]) -> str:
    parts = [tool["description"]] if isinstance(tool.get("description"), str) and tool["description"] else []
    parts.append("This tool takes free-form text, not JSON: pass the whole text as the string argument `input`.")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        syntax = fmt.get("syntax") or "lark"
        parts.append(f"The text must match this {syntax} grammar:\n```{syntax}\n{fmt['definition']}\n```")
    return "\n\n".join(parts)


def custom_input(arguments: Any) -> str:
    """The freeform text of a custom tool's call, from the arguments the backend produced.

    Lenient with weak models: ``{"input": text}`` is the contract, but a one-key object holding a string,
    a bare JSON string or text that is not JSON at all are taken as the text too.
    """
    value = arguments
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return value["input"]
        if len(value) == 1 and isinstance(next(iter(value.values())), str):
            return next(iter(value.values()))
    elif isinstance(value, str):
        return value
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
