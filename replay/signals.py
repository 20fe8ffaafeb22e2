"""Reward signals: plain callables over a loaded trajectory, registered by name.

A signal returns a number in [0, 1], or ``None`` when it cannot tell (unknown). Penalties are positive
amounts too; the weight's sign in ``[rewards]`` alone says whether a signal helps or hurts. A signal may
also credit single steps: a ``per_step(view)`` method returning ``{model call seq: value in [0, 1]}``.

A new signal is one small class (or function) registered by name::

    @register_signal("cites_sources")
    class CitesSources:
        def __call__(self, view: TrajectoryView) -> float | None:
            return 1.0 if "http" in (view.final_answer or "") else 0.0

and weighted in the config: ``[rewards] cites_sources = 0.2`` (unweighted signals are stored, not summed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import orjson

from replay.hashing import exact_json
from replay.model import Feedback, ToolCall
from replay.vocabulary import DEADLINE, LOOP_DETECTED, MAX_STEPS, MAX_TOTAL_TOKENS, TOOL_FAILURES

# Terminations that cost the whole illegal-action penalty: the run looped or spent a budget.
PENALISED_TERMINATIONS = frozenset({LOOP_DETECTED, MAX_STEPS, MAX_TOTAL_TOKENS, DEADLINE, TOOL_FAILURES})
# The step limit assumed where neither the run nor its profile says (the agent loop's own default).
DEFAULT_STEP_LIMIT = 10
# The shortest string from a tool result that counts as used when it reappears.
MIN_USED_STRING = 8


# -- the view ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrajectoryView:
    """What signals see of one trajectory."""

    id: str
    source: str
    status: str
    termination_reason: str | None
    messages: list[dict[str, Any]]  # the last model call's messages as sent, plus its reply
    tool_calls: list[ToolCall]  # in the order made
    final_answer: str | None
    steps: int  # model calls that were steps (summaries excluded)
    step_seqs: list[int]  # their seqs
    step_limit: int
    feedback: list[Feedback]  # from everyone but the reward engine, oldest first
    task_id: str | None = None
    profile: str | None = None
    metadata: dict[str, Any] | None = None

    def calls_by_step(self) -> dict[int, list[ToolCall]]:
        out: dict[int, list[ToolCall]] = {}
        for call in self.tool_calls:
            out.setdefault(call.step, []).append(call)
        return out


# -- the registry ------------------------------------------------------------------------------------


@runtime_checkable
class Signal(Protocol):
    def __call__(self, view: TrajectoryView) -> float | None: ...


SIGNALS: dict[str, Callable[[TrajectoryView], float | None]] = {}

S = TypeVar("S")


def register_signal(name: str, *, replace: bool = False) -> Callable[[S], S]:
    """Register a signal by name: a class (instantiated once, without arguments) or a function."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name) or name == "success_unknown":
        raise ValueError(f"{name!r} cannot name a signal")

    def add(obj: S) -> S:
        if name in SIGNALS and not replace:
            raise ValueError(f"a signal named {name!r} is already registered")
        fn = obj() if isinstance(obj, type) else obj
        if not callable(fn):
            raise TypeError(f"signal {name!r} is not callable")
        SIGNALS[name] = fn  # type: ignore[assignment]
        return obj

    return add


def unregister_signal(name: str) -> None:
    SIGNALS.pop(name, None)


# -- how results get used ----------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?![\d])")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TRIM = "\"'`.,;:!?()[]{}<>"


def _numbers(text: str) -> set[str]:
    return set(_NUMBER.findall(_THOUSANDS.sub("", text)))


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


@dataclass(frozen=True)
class Evidence:
    """What of a tool result would show that it got used: its numbers and its longer strings."""

    numbers: frozenset[str]
    strings: frozenset[str]  # casefolded, each at least MIN_USED_STRING characters

    @property
    def empty(self) -> bool:
        return not self.numbers and not self.strings


def evidence(result: str) -> Evidence:
    """The numbers and the strings of at least 8 characters a result holds.

    A JSON result is read leaf by leaf (keys are not evidence); text is read as it is. From every
    string: the whole (trimmed) string, each whitespace-separated token, and each number in it.
    """
    try:
        parsed = orjson.loads(result)
        leaves = list(_leaves(parsed))
    except orjson.JSONDecodeError:
        leaves = [result]
    numbers: set[str] = set()
    strings: set[str] = set()
    for leaf in leaves:
        if isinstance(leaf, bool) or leaf is None:
            continue
        if isinstance(leaf, int):
            numbers.add(str(abs(leaf)))
            continue
        if isinstance(leaf, float):
            if math.isfinite(leaf):
                text = repr(abs(leaf))
                numbers.add(format(abs(leaf), "f").rstrip("0").rstrip(".") if "e" in text else text)
            continue
        text = str(leaf)
        numbers.update(_numbers(text))
        whole = text.strip().strip(_TRIM).casefold()
        if len(whole) >= MIN_USED_STRING:
            strings.add(whole)
        for token in text.split():
            token = token.strip(_TRIM).casefold()
            if len(token) >= MIN_USED_STRING:
                strings.add(token)
    return Evidence(frozenset(numbers), frozenset(strings))


def _number_matches(found: str, target: str) -> bool:
    """``target`` (from a later call or the answer) states ``found`` (from a result), maybe rounded."""
    f, t = float(found), float(target)
    if f == t:
        return True
    decimals = len(target.partition(".")[2])
    found_decimals = len(found.partition(".")[2])
    return found_decimals > decimals and round(f, decimals) == t


@dataclass(frozen=True)
class Target:
    """Text a result may reappear in: a later call's arguments or the final answer."""

    text: str
    numbers: frozenset[str]

    @classmethod
    def of(cls, text: str) -> Target:
        return cls(text.casefold(), frozenset(_numbers(text)))


def used_in(ev: Evidence, targets: Iterable[Target]) -> bool:
    for target in targets:
        if any(s in target.text for s in ev.strings):
            return True
        if any(_number_matches(n, t) for n in ev.numbers for t in target.numbers):
            return True
    return False


def usage(view: TrajectoryView) -> dict[int, bool]:
    """For each successful tool call (by its index in ``view.tool_calls``): whether its result got used —
    a number, or a string of at least 8 characters, from it appears in the arguments of a call made at a
    later step or in the final answer. A call that repeats an earlier successful one (same tool, same
    arguments) learnt nothing new: it counts as unused, so repeating a good call is padding, not credit."""
    final = Target.of(view.final_answer) if view.final_answer else None
    by_step: dict[int, list[Target]] = {}
    for call in view.tool_calls:
        by_step.setdefault(call.step, []).append(Target.of(call.arguments or ""))
    out: dict[int, bool] = {}
    done: set[tuple[str | None, bytes]] = set()
    for i, call in enumerate(view.tool_calls):
        if not call.succeeded:
            continue
        key = (call.name, _canonical(call.arguments))
        ev = evidence(call.result or "")
        later = [t for step, targets in by_step.items() if step > call.step for t in targets]
        if final is not None:
            later.append(final)
        out[i] = key not in done and not ev.empty and used_in(ev, later)
        done.add(key)
    return out


def _canonical(arguments: str | None) -> bytes:
    try:
        return exact_json(orjson.loads(arguments or "null"))
    except orjson.JSONDecodeError:
        return (arguments or "").encode()


def _validity(calls: list[ToolCall], used: dict[int, bool], indexes: list[int]) -> float:
    """Share of valid calls times share of successful results used (0 when none succeeded)."""
    valid = sum(1 for c in calls if c.valid) / len(calls)
    ok = [i for i in indexes if i in used]
    return valid * (sum(1 for i in ok if used[i]) / len(ok) if ok else 0.0)


# -- the built-in signals ----------------------------------------------------------------------------

POSITIVE_LABELS = frozenset({"up", "thumbs_up", "thumbs-up", "success", "pass", "passed"})
NEGATIVE_LABELS = frozenset({"down", "thumbs_down", "thumbs-down", "failure", "fail", "failed"})


def feedback_outcome(row: Feedback) -> float | None:
    """A feedback row as a success value: thumbs up/down → 1/0, label success/failure → 1/0, a score in
    [0, 1] → itself; anything else → None (not an outcome)."""
    if row.label:
        label = row.label.strip().casefold()
        if label in POSITIVE_LABELS:
            return 1.0
        if label in NEGATIVE_LABELS:
            return 0.0
    value = row.value
    if value is None or not math.isfinite(value):
        return None
    if row.name.casefold() in ("thumbs", "thumb"):
        return 1.0 if value > 0 else 0.0
    return float(value) if 0.0 <= value <= 1.0 else None


def latest_outcome(view: TrajectoryView, source: str) -> float | None:
    """The newest usable outcome among the rows of ``source`` (a later verdict replaces an earlier one)."""
    for row in reversed(view.feedback):
        if row.source == source:
            outcome = feedback_outcome(row)
            if outcome is not None:
                return outcome
    return None


@register_signal("task_success")
class TaskSuccess:
    """The task's verifier where there is one, else the user's feedback, else unknown."""

    def __call__(self, view: TrajectoryView) -> float | None:
        verdict = latest_outcome(view, "verifier")
        return verdict if verdict is not None else latest_outcome(view, "user")


@register_signal("process_validity")
class ProcessValidity:
    """Share of valid tool calls × share of successful results used later; padding earns nothing.

    No tool calls at all: 0.0 (nothing was done to credit: an answer given without acting must not outscore
    one that acted, whether or not acting was needed; a right refusal earns task_success). Calls made but
    none succeeded: 0.0 (no result was there to use).
    """

    def __call__(self, view: TrajectoryView) -> float | None:
        if not view.tool_calls:
            return 0.0
        return _validity(view.tool_calls, usage(view), list(range(len(view.tool_calls))))

    def per_step(self, view: TrajectoryView) -> dict[int, float]:
        """Each step that called tools: the same product over that step's calls."""
        used = usage(view)
        out: dict[int, float] = {}
        for step in sorted({c.step for c in view.tool_calls}):
            indexes = [i for i, c in enumerate(view.tool_calls) if c.step == step]
            out[step] = _validity([view.tool_calls[i] for i in indexes], used, indexes)
        return out


@register_signal("illegal_action_penalty")
class IllegalActionPenalty:
    """Share of steps with invalid or refused calls (unknown or forbidden tools are invalid); 1 when
    the run ended in a loop or on a budget."""

    def __call__(self, view: TrajectoryView) -> float | None:
        if view.termination_reason in PENALISED_TERMINATIONS:
            return 1.0
        if view.steps <= 0:
            return 0.0
        bad = {c.step for c in view.tool_calls if c.refused}
        return min(1.0, len(bad) / view.steps)

    def per_step(self, view: TrajectoryView) -> dict[int, float]:
        """Each step that called tools: 1 if any of its calls was invalid or refused, else 0."""
        return {step: 1.0 if any(c.refused for c in calls) else 0.0
                for step, calls in sorted(view.calls_by_step().items())}


@register_signal("efficiency")
class Efficiency:
    """1 - (actions - 1) / step_limit, clipped to [0, 1], where actions is the number of steps or, when more,
    the tool calls plus the answer (if any): one step is 1.0, and calls made side by side in one step cost as much as
    calls made one after another (padding a step with extra calls is not free). Unknown without any step."""

    def __call__(self, view: TrajectoryView) -> float | None:
        if view.steps <= 0:
            return None
        limit = view.step_limit if view.step_limit > 0 else DEFAULT_STEP_LIMIT
        actions = max(view.steps, len(view.tool_calls) + (view.final_answer is not None))
        return min(1.0, max(0.0, 1.0 - (actions - 1) / limit))


BUILTIN_SIGNALS = ("task_success", "process_validity", "illegal_action_penalty", "efficiency")
