"""Checks a tool call before it runs, with messages a model can act on.

The tool must exist and be allowed, its arguments must be a JSON object (small faults are repaired
and flagged), and they must satisfy the tool's JSON Schema (Draft 2020-12). Errors name the path:
``arguments.city: 'city' is a required property``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from json_repair import repair_json
from jsonschema import Draft202012Validator

from tools.executor import schema_errors as tool_schema_errors


@dataclass
class CheckedCall:
    id: str
    name: str
    raw_arguments: str
    arguments: dict[str, Any] | None  # parsed (and maybe repaired) arguments
    parsed: bool
    repaired: bool
    error: str | None  # why the call is invalid; None when it may run

    @property
    def valid(self) -> bool:
        return self.error is None

    def arguments_json(self) -> str:
        """The arguments to send on: repaired where they needed it."""
        if self.arguments is None:
            return self.raw_arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@lru_cache(maxsize=512)
def _validator(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json))


def schema_errors(schema: dict[str, Any] | None, arguments: Any) -> list[str]:
    """Every way ``arguments`` break ``schema``, each naming the path (the tools' own rule, for any schema)."""
    if not schema:
        return []
    return tool_schema_errors(_validator(json.dumps(schema, sort_keys=True)), arguments)


def parse_arguments(raw: Any) -> tuple[dict[str, Any] | None, bool]:
    """(arguments, repaired); None when no JSON object can be had from ``raw``."""
    if isinstance(raw, dict):
        return raw, False
    if not isinstance(raw, str) or not raw.strip():
        return ({}, False) if raw in ("", None) else (None, False)
    try:
        value = json.loads(raw)
        repaired = False
    except ValueError:
        value = repair_json(raw, return_objects=True)
        repaired = True
    return (value, repaired) if isinstance(value, dict) else (None, repaired)


def check_call(call_id: str, name: str, raw_arguments: Any, schemas: Mapping[str, dict[str, Any] | None],
               allowed: set[str] | None = None, *, already_repaired: bool = False) -> CheckedCall:
    """Validate one call against the tools on offer (``schemas``: name → JSON Schema of its arguments)."""
    raw = raw_arguments if isinstance(raw_arguments, str) else json.dumps(raw_arguments)
    if name not in schemas or (allowed is not None and name not in allowed):
        offered = ", ".join(sorted(schemas if allowed is None else set(schemas) & allowed)) or "none"
        return CheckedCall(call_id, name, raw, None, False, False,
                           f"Unknown tool '{name}'. Available tools: {offered}.")
    arguments, repaired = parse_arguments(raw_arguments)
    repaired = repaired or already_repaired
    if arguments is None:
        return CheckedCall(call_id, name, raw, None, False, repaired,
                           f"arguments: not a JSON object: {raw[:200]!r}")
    errors = [*_wide_integers(arguments, "arguments"), *schema_errors(schemas[name], arguments)]
    return CheckedCall(call_id, name, raw, arguments, True, repaired, "; ".join(errors) if errors else None)


# JSON allows integers of any size; what stores, hashes and sends the arguments on (orjson, SQLite) takes 64 bits.
_SMALLEST, _LARGEST = -(2 ** 63), 2 ** 64 - 1


def _wide_integers(value: Any, path: str) -> list[str]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [] if _SMALLEST <= value <= _LARGEST else [f"{path}: the integer {str(value)[:24]}... does not fit in "
                                                          "64 bits"]
    if isinstance(value, dict):
        return [e for key, item in value.items() for e in _wide_integers(item, f"{path}.{key}")]
    if isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _wide_integers(item, f"{path}[{i}]")]
    return []


def function_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any] | None]:
    """name → parameters schema, from OpenAI ``tools``."""
    out: dict[str, dict[str, Any] | None] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out
