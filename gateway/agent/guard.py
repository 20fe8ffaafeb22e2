"""Guarding clients' own agent loops (proxy mode): the tool calls a model returns are checked against
the client's own tool schemas, and an invalid call is sent back to the model with the validation error
before anything reaches the client."""

from __future__ import annotations

from typing import Any

from gateway.agent.parsing import parse_message
from gateway.agent.validation import CheckedCall, check_call

RETRY_NOTE = ("Invalid call to {name}: {error}. Nothing was run. Call the tool again with corrected arguments.")
NOT_RUN = "Not run: another call in this message was invalid. Repeat this call together with the corrected one."


def check_message(message: dict[str, Any], schemas: dict[str, dict[str, Any] | None]) -> list[CheckedCall]:
    """Each tool call of an assistant message, checked against the schemas the client offered."""
    return [check_call(c.id, c.name, c.arguments, schemas, already_repaired=c.repaired)
            for c in parse_message(message).calls]


def retry_messages(sent: list[dict[str, Any]], message: dict[str, Any],
                   checked: list[CheckedCall]) -> list[dict[str, Any]]:
    """The conversation to send again: the invalid answer, then one ``tool`` message per call saying why."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.raw_arguments}}
             for c in checked]
    out = [*sent, {"role": "assistant", "content": message.get("content"), "tool_calls": calls}]
    for c in checked:
        note = NOT_RUN if c.valid else RETRY_NOTE.format(name=c.name, error=c.error)
        out.append({"role": "tool", "tool_call_id": c.id, "content": note})
    return out


def tool_rows(checked: list[CheckedCall], outcome: str) -> list[dict[str, Any]]:
    """What the trajectory records of each checked call: ``returned`` to the client, or ``retried``."""
    return [{"call_id": c.id, "name": c.name, "raw_arguments": c.raw_arguments, "parsed": c.parsed,
             "repaired": c.repaired, "valid": c.valid, "validation_error": c.error, "status": outcome}
            for c in checked]
