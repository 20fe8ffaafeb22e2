"""Keeping an agent's context inside its budget: older turns become one summary message.

The system prompt and the user's goal stay; so do the last N turns. A turn starts at an assistant
message, so an assistant message with ``tool_calls`` and its ``tool`` results are never split.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (messages, the chat tools offered with them or None) -> tokens: a backend's own ``count_tokens`` has this shape.
TokenCounter = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], int]

SUMMARY_PREFIX = "[Summary of earlier steps]\n"
SUMMARY_INSTRUCTIONS = (
    "Summarize the conversation below for the assistant that will continue the task: what was tried, "
    "which tool results matter (keep exact numbers, names and identifiers), and what is still open. "
    "Be brief and factual."
)


def approximate_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """Four characters a token: the fallback where no tokenizer is at hand."""
    chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
    return (chars + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)) // 4 + 1


@dataclass
class Split:
    head: list[dict[str, Any]]  # system prompt and the user's goal
    middle: list[dict[str, Any]]  # what the summary replaces
    tail: list[dict[str, Any]]  # the last turns, kept as they are


def split_for_summary(messages: list[dict[str, Any]], keep_last_turns: int) -> Split | None:
    """Where to cut, or None when there is nothing old enough to summarize."""
    goal = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if goal is None:
        return None
    head_end = goal + 1
    turn_starts = [i for i in range(head_end, len(messages)) if messages[i].get("role") == "assistant"]
    if len(turn_starts) <= keep_last_turns:
        return None
    tail_start = turn_starts[-keep_last_turns] if keep_last_turns > 0 else len(messages)
    middle = messages[head_end:tail_start]
    if not middle:
        return None
    return Split(messages[:head_end], middle, messages[tail_start:])


def render_for_summary(middle: list[dict[str, Any]], max_chars: int | None = None) -> str:
    """The turns as lines of text; past ``max_chars``, the newest that fit."""
    lines = []
    for m in middle:
        role = m.get("role")
        if m.get("tool_calls"):
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                lines.append(f"assistant called {fn.get('name')}({fn.get('arguments')})")
        if m.get("content"):
            label = f"result of {m.get('tool_call_id')}" if role == "tool" else role
            lines.append(f"{label}: {m['content']}")
    text = "\n".join(lines)
    return text if max_chars is None or len(text) <= max_chars else "…" + text[-max_chars:]


def extractive_summary(middle: list[dict[str, Any]], max_chars: int = 2000) -> str:
    """A summary without a model: the calls made and the start of each result, newest kept first."""
    names = {}
    lines = []
    for m in middle:
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            names[call.get("id")] = fn.get("name")
            lines.append(f"- called {fn.get('name')}({fn.get('arguments')})")
        if m.get("role") == "tool":
            text = str(m.get("content") or "").replace("\n", " ")
            lines.append(f"  → {names.get(m.get('tool_call_id'), 'tool')}: {text[:200]}")
        elif m.get("role") == "assistant" and m.get("content"):
            lines.append(f"- said: {str(m['content'])[:200]}")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else "…" + text[-max_chars:]


def summary_message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": SUMMARY_PREFIX + text.strip()}


def summary_request(middle: list[dict[str, Any]], max_chars: int | None = None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SUMMARY_INSTRUCTIONS},
            {"role": "user", "content": render_for_summary(middle, max_chars)}]


def with_tool_results(messages: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` joined to the tool messages that answer the last assistant tool-call message, before any nudge
    that followed them, and in the order of the calls: every call keeps its result next to it."""
    at = next((i for i in range(len(messages) - 1, -1, -1)
               if messages[i].get("role") == "assistant" and messages[i].get("tool_calls")), None)
    if at is None:
        return messages + results
    end = at + 1
    while end < len(messages) and messages[end].get("role") == "tool":
        end += 1
    order = {c["id"]: n for n, c in enumerate(messages[at]["tool_calls"])}
    block = sorted(messages[at + 1:end] + results, key=lambda m: order.get(m.get("tool_call_id"), len(order)))
    return messages[:at + 1] + block + messages[end:]
