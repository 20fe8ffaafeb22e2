"""Tool calls out of model output: native ``tool_calls``, Hermes ``<tool_call>{...}</tool_call>`` blocks and
fenced JSON (```json {"name": ..., "arguments": ...}```) → OpenAI ``tool_calls``.

Pure functions, no I/O. Small JSON faults are repaired with ``json_repair`` and flagged; text that
holds no usable call stays content — a call is never invented.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from json_repair import repair_json

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments``
    raw: str  # the block's text as the model wrote it
    repaired: bool  # the JSON needed repair to parse

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside the parsed blocks; None when only whitespace is left
    calls: list[ParsedCall] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # blocks with no usable call, left in ``content``

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [call.to_openai() for call in self.calls]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split ``text`` into content and the tool calls of its ``<tool_call>`` blocks.

    Several blocks may appear; the last may be unterminated (generation stopped inside it).
    """
    content: list[str] = []
    calls: list[ParsedCall] = []
    invalid: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        content.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        body_end, pos = (len(text), len(text)) if end == -1 else (end, end + len(TOOL_CALL_CLOSE))
        found = _calls_in_block(text[body_start:body_end])
        if found:
            calls.extend(found)
        else:
            invalid.append(text[start:pos])
            content.append(text[start:pos])
    content.append(text[pos:])
    joined = "".join(content)
    return ParsedOutput(content=joined if joined.strip() else None, calls=calls, invalid=invalid)


_FENCE = re.compile(r"```(?:json|tool_call|tool)?[ \t]*\n(.*?)```", re.S)


def parse_text(text: str) -> ParsedOutput:
    """Hermes blocks first; failing those, fenced JSON blocks that hold a call (several allowed)."""
    parsed = parse_tool_calls(text)
    if parsed.calls:
        return parsed
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    for match in _FENCE.finditer(text):
        found = _calls_in_block(match.group(1))
        if not found:
            continue
        content.append(text[pos:match.start()])
        calls.extend(found)
        pos = match.end()
    if not calls:
        return parsed
    content.append(text[pos:])
    joined = "".join(content)
    return ParsedOutput(content=joined if joined.strip() else None, calls=calls, invalid=parsed.invalid)


def parse_message(message: dict[str, Any]) -> ParsedOutput:
    """The calls of an assistant message: its native ``tool_calls`` if it has any, else those in its text."""
    native = message.get("tool_calls") or []
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if native:
        calls = [ParsedCall(id=c.get("id") or new_call_id(), name=(c.get("function") or {}).get("name") or "",
                            arguments=(c.get("function") or {}).get("arguments") or "",
                            raw=(c.get("function") or {}).get("arguments") or "", repaired=False)
                 for c in native]
        return ParsedOutput(content=content or None, calls=calls)
    return parse_text(content or "")


def _load_json(raw: str) -> tuple[Any, bool]:
    """The JSON value in ``raw`` and whether it needed repair; ``None`` when there is none."""
    try:
        return json.loads(raw), False
    except ValueError:
        repaired = repair_json(raw, return_objects=True)
        return (repaired if repaired not in ("", None) else None), True


def _calls_in_block(body: str) -> list[ParsedCall]:
    raw = body.strip()
    if not raw:
        return []
    value, repaired = _load_json(raw)
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = _call_from_object(item, raw, repaired)
        if call is None:
            return []  # one unusable entry makes the whole block suspect: leave it to the reader
        calls.append(call)
    return calls


def _call_from_object(obj: Any, raw: str, repaired: bool) -> ParsedCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models encode the arguments twice, as OpenAI does
        decoded, fixed = _load_json(arguments) if arguments.strip() else ({}, False)
        if decoded is not None:
            arguments, repaired = decoded, repaired or fixed
    if arguments is None:
        arguments = {}
    return ParsedCall(id=new_call_id(), name=name.strip(), raw=raw, repaired=repaired,
                      arguments=json.dumps(arguments, ensure_ascii=False))


def partial_suffix_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is the start of one of ``markers`` (not all of it).

    That much must be held back while streaming: the next delta may complete the marker.
    """
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ToolCallStreamFilter:
    """Releases streamed text as content only while it cannot be tool-call markup.

    Everything from a ``<tool_call>`` on is held, as is a possible start of one and text that is
    so far only whitespace (it is dropped if a call follows). ``finish`` parses the whole text and
    returns what content is still owed, so the released pieces add up to ``ParsedOutput.content``.
    """

    def __init__(self) -> None:
        self._text = ""
        self._released = 0
        self._blocked = False

    def feed(self, delta: str) -> str:
        self._text += delta
        if self._blocked:
            return ""
        marker = self._text.find(TOOL_CALL_OPEN, self._released)
        if marker != -1:
            self._blocked = True
            limit = marker
        else:
            limit = len(self._text) - partial_suffix_length(self._text, (TOOL_CALL_OPEN,))
        if limit <= self._released or not self._text[:limit].strip():
            return ""
        out = self._text[self._released:limit]
        self._released = limit
        return out

    def finish(self) -> tuple[str, ParsedOutput]:
        """(content not yet released, the parse of the whole text)."""
        parsed = parse_tool_calls(self._text)
        content = parsed.content or ""
        released = self._text[:self._released]
        return (content[len(released):] if content.startswith(released) else ""), parsed
