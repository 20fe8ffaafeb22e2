"""What makes an agent stop: step, token and time budgets, failing tools, and repeated calls.

Checked in one place. Each stop is a ``Termination`` carrying its named reason; the limiter keeps only
counters, so it is persisted with the run and a resumed run keeps its spent budgets.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from gateway.config import ProfileSettings
from replay.vocabulary import DEADLINE, LOOP_DETECTED, MAX_STEPS, MAX_TOTAL_TOKENS, TOOL_FAILURES


class Termination(Exception):
    """The run must stop; ``reason`` is one of the names above."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """0 (or None) switches a limit off. Built in code (a test, a training episode) it has the limits a configured
    ``[[profiles]]`` entry has by default."""

    max_steps: int = ProfileSettings.default_of("max_steps")
    max_total_tokens: int = ProfileSettings.default_of("max_total_tokens")
    deadline_seconds: float = ProfileSettings.default_of("deadline_seconds")
    max_consecutive_tool_failures: int = ProfileSettings.default_of("max_consecutive_tool_failures")
    # the same call, not back to back, before it is refused
    max_repeats: int = ProfileSettings.default_of("max_repeats")

    def tightened(self, **overrides: Any) -> Limits:
        """A request may tighten its profile's limits, never loosen them."""
        values = asdict(self)
        for key, value in overrides.items():
            if value is None or key not in values:
                continue
            current = values[key]
            values[key] = value if not current else min(current, value) if value else current
        return Limits(**values)


def call_signature(name: str, arguments: Any) -> str:
    return name + "\x00" + orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()


@dataclass
class Budget:
    """Spent budgets and the counters behind loop and failure detection."""

    steps: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.time)
    consecutive_failures: dict[str, int] = field(default_factory=dict)
    previous_step_calls: list[str] = field(default_factory=list)
    refused_repeat: list[str] = field(default_factory=list)
    call_counts: dict[str, int] = field(default_factory=dict)
    # Where the current turn began: a conversation's limits apply to each user message, not to its whole life.
    turn_first_step: int = 0
    turn_first_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def new_turn(self) -> None:
        """A new user message: steps, tokens, time and the loop counters count again from here."""
        self.turn_first_step, self.turn_first_tokens = self.steps, self.total_tokens
        self.started_at = time.time()
        self.consecutive_failures, self.previous_step_calls, self.refused_repeat, self.call_counts = {}, [], [], {}


class Limiter:
    """Holds a run to its ``Limits``: checks the budget it spends and raises the ``Termination`` that stops it."""

    def __init__(self, limits: Limits, budget: Budget | None = None) -> None:
        self.limits = limits
        self.budget = budget or Budget()

    def before_model_call(self) -> None:
        lim, b = self.limits, self.budget
        if lim.max_steps and b.steps - b.turn_first_step >= lim.max_steps:
            raise Termination(MAX_STEPS, f"reached the limit of {lim.max_steps} steps")
        spent = b.total_tokens - b.turn_first_tokens
        if lim.max_total_tokens and spent >= lim.max_total_tokens:
            raise Termination(MAX_TOTAL_TOKENS, f"spent {spent} of {lim.max_total_tokens} tokens")
        if self.past_deadline():
            raise Termination(DEADLINE, f"ran past its deadline of {lim.deadline_seconds:g} s")

    def tokens_left(self) -> int | None:
        """What this turn may still spend on tokens, or None without a token budget."""
        if not self.limits.max_total_tokens:
            return None
        return self.limits.max_total_tokens - (self.budget.total_tokens - self.budget.turn_first_tokens)

    def past_deadline(self) -> bool:
        return bool(self.limits.deadline_seconds) and \
            time.time() - self.budget.started_at >= self.limits.deadline_seconds

    def seconds_left(self) -> float | None:
        if not self.limits.deadline_seconds:
            return None
        return max(0.0, self.limits.deadline_seconds - (time.time() - self.budget.started_at))

    def can_wrap_up(self) -> bool:
        """Whether one more model call fits: then a stopped run is asked for its best final answer."""
        try:
            self.before_model_call()
        except Termination:
            return False
        return True

    def spent(self, usage: dict[str, Any] | None) -> None:
        self.budget.steps += 1
        usage = usage or {}
        self.budget.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.budget.completion_tokens += int(usage.get("completion_tokens") or 0)

    def check_repeat(self, signature: str, name: str) -> str | None:
        """A message refusing the call, or None to run it; a second back-to-back repeat ends the run.

        Back to back means the same call was made in the previous step. Repeats that are not back to
        back (polling) are allowed up to ``max_repeats``.
        """
        b = self.budget
        if signature in b.previous_step_calls:
            if signature in b.refused_repeat:
                raise Termination(LOOP_DETECTED, f"repeated the call to {name} with the same arguments again")
            b.refused_repeat.append(signature)
            return (f"Refused: this exact call to {name} was just made with the same arguments and its result is "
                    "above. Use that result, change the arguments, or answer.")
        count = b.call_counts.get(signature, 0)
        if self.limits.max_repeats and count >= self.limits.max_repeats:
            return (f"Refused: {name} has already been called {count} times with these arguments. "
                    "Use the results you have or try something else.")
        return None

    def end_step(self, signatures: list[str], *, failed: set[str] | frozenset[str] = frozenset()) -> None:
        """Count the step's calls; those in ``failed`` may be repeated at once (a retry), the rest may not."""
        b = self.budget
        for sig in signatures:
            b.call_counts[sig] = b.call_counts.get(sig, 0) + 1
        b.refused_repeat = [s for s in b.refused_repeat if s in signatures]
        b.previous_step_calls = [s for s in signatures if s not in failed]

    def tool_result(self, name: str, ok: bool) -> str | None:
        """Count failures per tool; a nudge when a tool keeps failing, and a stop after as many more."""
        b = self.budget
        if ok:
            b.consecutive_failures[name] = 0
            return None
        n = b.consecutive_failures.get(name, 0) + 1
        b.consecutive_failures[name] = n
        limit = self.limits.max_consecutive_tool_failures
        if not limit:
            return None
        if n >= 2 * limit:
            raise Termination(TOOL_FAILURES, f"{name} failed {n} times in a row")
        if n == limit:
            return (f"{name} has failed {n} times in a row. Change your approach: try different arguments or "
                    "another tool, or report what you could not do.")
        return None
