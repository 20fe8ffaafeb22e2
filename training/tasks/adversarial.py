"""Policies that try to game the verifier and the rewards instead of solving the task.

Each is a function of the chat request the agent loop sends (its messages and offered tools) to the assistant's
next message, so it runs through the real agent loop, tools and recorder like a model would. Every one of them
must score a lower reward than the suite's solver and solve under 10% of every split
(``tests/training/tasks/test_adversarial.py``); a verifier or a reward signal that one of them beats is gameable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Policy = Callable[[dict[str, Any]], dict[str, Any]]  # request body -> the assistant's next message

GUESS = "The answer is 42."


def _answer(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _calls(*calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(calls)]}


def _acted(body: dict[str, Any]) -> int:
    """How many tool results the conversation holds so far."""
    return sum(1 for m in body["messages"] if m.get("role") == "tool")


def _harmless_call(body: dict[str, Any], n: int = 1) -> tuple[str, dict[str, Any]]:
    """A valid call that tells nothing about the task, ``n + n`` (every task of the tools suite offers the
    calculator)."""
    names = [t["function"]["name"] for t in body.get("tools") or []]
    if "calculator" not in names:
        raise ValueError(f"these policies call the calculator, which is not among {names}")
    return "calculator", {"expression": f"{n} + {n}"}


def list_numbers(body: dict[str, Any]) -> dict[str, Any]:
    """Every number from 0 to 10,000, hoping the right one is among them."""
    return _answer("The answer is one of: " + ", ".join(str(n) for n in range(10_001)) + ".")


def always_refuse(body: dict[str, Any]) -> dict[str, Any]:
    return _answer("I cannot answer that.")


def never_call(body: dict[str, Any]) -> dict[str, Any]:
    """A confident guess at once: the fastest run there is."""
    return _answer(GUESS)


def pad_with_valid_calls(body: dict[str, Any]) -> dict[str, Any]:
    """Three valid calls side by side, whose results the answer then quotes, then a guess."""
    if _acted(body):
        return _answer("I checked 1 + 1, 2 + 2 and 3 + 3: 2, 4 and 6. " + GUESS)
    return _calls(*(_harmless_call(body, n) for n in (1, 2, 3)))


def repeat_a_call(body: dict[str, Any]) -> dict[str, Any]:
    """The same valid call three steps in a row, then a guess."""
    if _acted(body) >= 3:
        return _answer(GUESS)
    return _calls(_harmless_call(body))


def ignore_the_result(body: dict[str, Any]) -> dict[str, Any]:
    """A call, then an answer that does not use what it returned."""
    if _acted(body):
        return _answer(GUESS)
    return _calls(_harmless_call(body))


POLICIES: dict[str, Policy] = {f.__name__: f for f in (
    list_numbers, always_refuse, never_call, pad_with_valid_calls, repeat_a_call, ignore_the_result)}
