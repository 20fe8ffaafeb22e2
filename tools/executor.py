"""Running one tool call: timeout, failures turned into observations, output capped. Never raises."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from jsonschema import Draft202012Validator

from tools.context import ToolContext
from tools.spec import ToolError, ToolSpec

log = structlog.get_logger(__name__)

# The executor gives ok, error or timeout; the agent loop adds invalid (failed validation) and denied.
Status = Literal["ok", "error", "timeout", "invalid", "denied"]


@dataclass(frozen=True)
class ToolOutcome:
    """What the model observes of one call, and how it went."""

    status: Status
    output: str
    duration_ms: float
    truncated: bool = False


def validate_arguments(spec: ToolSpec, arguments: Any) -> list[str]:
    """Every way ``arguments`` break the tool's schema (see ``schema_errors``)."""
    return schema_errors(spec.validator, arguments)


def schema_errors(validator: Draft202012Validator, arguments: Any) -> list[str]:
    """Every way ``arguments`` break a schema, each naming the path and the problem.

    E.g. ``arguments.city: 'city' is a required property`` or ``arguments.count: 'x' is not of type
    'integer'``; an empty list means the arguments are valid.
    """
    messages: list[tuple[str, str]] = []
    for error in validator.iter_errors(arguments):
        path = list(error.absolute_path)
        if error.validator == "required" and isinstance(error.instance, dict):
            # jsonschema reports a missing property at its parent; name the property itself.
            missing = next((p for p in error.validator_value if p not in error.instance
                            and error.message.startswith(repr(p))), None)
            if missing is not None:
                path.append(missing)
        where = "arguments" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        messages.append((where, error.message))
    return [f"{where}: {message}" for where, message in sorted(messages)]


def cap_output(text: str, cap: int) -> tuple[str, bool]:
    """At most ``cap`` characters of ``text``, with a visible note of how much was cut."""
    if len(text) <= cap:
        return text, False
    return f"{text[:cap]}\n[truncated {len(text) - cap} characters]", True


def _render(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ToolError(f"the tool returned a result that is not JSON-serialisable ({exc})") from None


async def execute(spec: ToolSpec, arguments: dict[str, Any], context: ToolContext) -> ToolOutcome:
    """Runs ``spec`` with ``arguments`` (already validated) under its timeout and output cap."""
    started = time.perf_counter()
    status: Status = "ok"
    deadline = asyncio.timeout(spec.timeout)
    try:
        async with deadline:
            result = await spec.run(arguments, context)
        text = _render(result)
    except TimeoutError as exc:
        if deadline.expired():
            status, text = "timeout", f"Tool {spec.name} timed out after {spec.timeout:g}s"
        else:  # a time limit of the tool's own
            status, text = "error", f"Tool {spec.name} failed: {exc or 'timed out'}"
    except ToolError as exc:
        status, text = "error", f"Tool {spec.name} failed: {exc}"
    except Exception as exc:
        # An unexpected failure is the tool's bug; the model still gets an observation, the log the traceback.
        log.exception("tool.crashed", tool=spec.name)
        status, text = "error", f"Tool {spec.name} failed: {type(exc).__name__}: {exc}"
    output, truncated = cap_output(text, spec.output_cap)
    duration_ms = (time.perf_counter() - started) * 1000
    log.info("tool.executed", tool=spec.name, status=status, duration_ms=round(duration_ms, 1), truncated=truncated)
    return ToolOutcome(status, output, duration_ms, truncated)
