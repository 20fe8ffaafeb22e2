"""What a task suite is: tasks in fixed splits, the tools they run with, a verifier and a solver.

A ``Suite`` hands out ``Task``s for ``train``, ``validation`` and ``test``; ``toolbox(task)`` gives the
tools one episode may use (a fresh call counter each time, so an injected ``Fault`` fires on the
configured call of that episode); ``verify`` judges an episode's final answer; ``solve`` produces the
conversation a perfect agent would have, by running the real tools.

Faults are ``ToolOutcome``s shaped like the executor's own (``tools/executor.py``):

- ``timeout``: status ``timeout``, ``Tool NAME timed out after Ns`` (N is the tool's own timeout);
- ``empty``: status ``ok`` with the empty output ``""``;
- ``error``: status ``error``, ``Tool NAME failed: reason`` with a plausible reason for that tool.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.prompting import message_text
from tools.context import ToolContext
from tools.executor import ToolOutcome
from tools.registry import ToolRegistry
from tools.spec import ToolSpec
from tools.toolbox import Toolbox

SPLITS = ("train", "validation", "test")
FAULT_KINDS = ("timeout", "empty", "error")

# Failure reasons an injected ``error`` fault reports, by tool; others get DEFAULT_FAULT_ERROR.
FAULT_ERRORS: dict[str, str] = {
    "sql_query": "OperationalError: database is locked",
    "calculator": "RuntimeError: the evaluation worker stopped unexpectedly",
    "convert_units": "ConnectionResetError: [Errno 104] Connection reset by peer",
}
DEFAULT_FAULT_ERROR = "ConnectionError: the service is temporarily unavailable"
# How the agent loop's tool messages for calls it did not run begin (gateway/agent/loop.py): invalid, refused.
NOT_RUN = ("Invalid call to ", "Refused", "Not run")

# What a refusal says; an answer containing one of these is a refusal (apostrophes normalised).
REFUSAL_PHRASES = ("cannot", "can't", "can not", "unable", "not able", "no information", "not available",
                   "don't have", "do not have")

REL_TOLERANCE = 1e-6
ABS_TOLERANCE = 0.01
# More distinct values than this that the prompt does not hold make a reply a list of guesses, not an answer.
MAX_STATED = 3

# Numbers as a model writes them: -12, 3.5, 5,200 (thousands separators), not the 2 of "x2".
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


@dataclass(frozen=True)
class Fault:
    """The ``call``-th execution of ``tool`` in an episode fails this way; later calls work."""

    tool: str
    kind: Literal["timeout", "empty", "error"]
    call: int = 1

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.call < 1:
            raise ValueError(f"fault call counts from 1, got {self.call}")


@dataclass(frozen=True)
class Direct:
    """The expected value of a task no offered tool fits: an answer given without any call, holding ``word`` (or
    one of ``also``, the same said otherwise: "8" for "eight")."""

    word: str
    also: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    id: str  # unique and stable, e.g. "tools/train/calc-017"
    suite: str
    family: str  # calculator, sql_lookup, chain, cannot, recovery, ...
    split: str
    prompt: str  # the user message
    tools: tuple[str, ...]  # the tools offered in this episode
    # a number, a string, a tuple of them (each must be stated: independent calls in one turn), None when the right
    # answer is that it cannot be answered, or a Direct when no offered tool fits and none may be called
    expected: Any
    fault: Fault | None = None

    @property
    def direct(self) -> bool:
        """Whether no offered tool fits: the task is answered without a call."""
        return isinstance(self.expected, Direct)

    @property
    def values(self) -> tuple[Any, ...]:
        """The values its answer must state (one, or each of a tuple's)."""
        return expected_values(self.expected)


def fault_outcome(spec: ToolSpec, kind: str) -> ToolOutcome:
    """The outcome an injected fault of ``kind`` gives for a call to ``spec``."""
    if kind == "timeout":
        return ToolOutcome("timeout", f"Tool {spec.name} timed out after {spec.timeout:g}s", spec.timeout * 1000)
    if kind == "empty":
        return ToolOutcome("ok", "", 1.0)
    if kind == "error":
        reason = FAULT_ERRORS.get(spec.name, DEFAULT_FAULT_ERROR)
        return ToolOutcome("error", f"Tool {spec.name} failed: {reason}", 2.0)
    raise ValueError(f"unknown fault kind {kind!r}")


class TaskToolbox:
    """One episode's tools (satisfies ``gateway.agent.loop.AllowedTools``), with the task's fault injected.

    ``executed`` lists every call as ``(name, arguments, outcome, injected)``, for evaluators that
    count failures and recoveries.
    """

    def __init__(self, inner: Toolbox, fault: Fault | None = None) -> None:
        self.inner = inner
        self.fault = fault
        self.counts: dict[str, int] = {}
        self.executed: list[tuple[str, dict[str, Any], ToolOutcome, bool]] = []

    def schemas(self) -> dict[str, dict[str, Any] | None]:
        return self.inner.schemas()

    def get(self, name: str) -> ToolSpec | None:
        return self.inner.get(name)

    def openai_tools(self) -> list[dict[str, Any]]:
        return self.inner.openai_tools()

    def resume(self, messages: list[dict[str, Any]]) -> None:
        """Count the calls a conversation so far ran (not those the agent loop refused or found invalid), so the
        fault fires on the call it would have fired on had the episode gone on."""
        for name, content in tool_results(messages):
            if name and not content.startswith(NOT_RUN):
                self.counts[name] = self.counts.get(name, 0) + 1

    async def execute(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        n = self.counts[name] = self.counts.get(name, 0) + 1
        spec = self.inner.get(name)
        fault = self.fault
        if fault is not None and spec is not None and fault.tool == name and fault.call == n:
            outcome, injected = fault_outcome(spec, fault.kind), True
        else:
            outcome, injected = await self.inner.execute(name, arguments), False
        self.executed.append((name, dict(arguments), outcome, injected))
        return outcome


# -- verifying ------------------------------------------------------------------------------------


def numbers_in(text: str) -> list[float]:
    """Every number written in ``text``, in order."""
    return [float(m.group().replace(",", "")) for m in _NUMBER.finditer(text)]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE)


def is_refusal(text: str) -> bool:
    low = text.lower().replace("\u2019", "'")
    return any(p in low for p in REFUSAL_PHRASES)


def check_final(expected: Any, final: str | None, prompt: str = "", alternatives: Iterable[str] = ()) -> bool:
    """The verifier's rule (see the module docstring of the suite and README.md): the value asked for, stated as
    the answer, not somewhere in a list.

    - no answer or a blank one fails;
    - ``expected is None`` (cannot be answered): the answer must refuse and must not state a number
      that is not in the prompt (that would be an invented answer);
    - otherwise a refusal fails;
    - a ``Direct``: its word must appear in the answer, as a whole word (``Suite.verify`` checks that no tool was
      called);
    - a number: the answer's last number must be it (relative tolerance 1e-6 or absolute 0.01), and the answer
      may state at most ``MAX_STATED`` distinct values the prompt does not hold (its working, not a list);
    - a string: it must appear in the answer (case-insensitively, as a whole word) and none of ``alternatives``
      (the other values it could have been, e.g. the other cities) may;
    - a tuple: each of its values must be stated (a number anywhere in the answer, a string as above), within the
      same limit of stated values, and no alternative that is none of them.
    """
    if final is None or not final.strip():
        return False
    if expected is None:
        if not is_refusal(final):
            return False
        given = numbers_in(prompt)
        return all(any(close(n, g) for g in given) for n in numbers_in(final))
    if is_refusal(final):
        return False
    if isinstance(expected, Direct):
        return any(_says(final, w) for w in (expected.word, *expected.also))
    values = expected_values(expected)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError(f"cannot verify an expected value of type {type(value).__name__}")
    numbers = numbers_in(final)
    if any(isinstance(v, int | float) for v in values) and _states_more(numbers, numbers_in(prompt), MAX_STATED):
        return False  # a list of guesses, however long
    strings = {v.lower() for v in values if isinstance(v, str)}
    if any(_says(final, other) for other in alternatives if other.lower() not in strings):
        return False
    if len(values) == 1 and isinstance(expected, int | float):
        return bool(numbers) and close(numbers[-1], float(expected))
    return all(_says(final, v) if isinstance(v, str) else any(close(n, float(v)) for n in numbers) for v in values)


def expected_values(expected: Any) -> tuple[Any, ...]:
    return expected if isinstance(expected, tuple) else (expected,)


def _states_more(numbers: list[float], given: list[float], limit: int) -> bool:
    """Whether an answer states more than ``limit`` distinct numbers its prompt does not hold (stops there: a list
    of guesses may be long)."""
    stated: list[float] = []
    for n in numbers:
        if not any(close(n, g) for g in given) and not any(close(n, s) for s in stated):
            stated.append(n)
            if len(stated) > limit:
                return True
    return False


def _says(text: str, value: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", text, re.IGNORECASE) is not None


def format_number(value: float | int) -> str:
    """How demonstrations write numbers: whole numbers without a point, others to at most 4 decimals."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


# -- solving --------------------------------------------------------------------------------------

Call = tuple[str, Mapping[str, Any]]  # a tool's name and its arguments


class Demonstration:
    """Builds a perfect agent's conversation by running calls through an episode's toolbox.

    ``call`` runs one tool call and records it; when the result is a failure (status other than
    ``ok``) or empty, it calls the tool again with ``retry`` arguments (or the same ones) and records
    that too: the recovery a demonstration should teach.
    """

    def __init__(self, toolbox: TaskToolbox, prompt: str,
                 retry: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.toolbox = toolbox
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        self.retry = retry
        self._ids = 0

    async def _turn(self, calls: Sequence[Call]) -> list[ToolOutcome]:
        """One assistant turn making ``calls`` (several: parallel tool calls), then their results in order."""
        ids = []
        for _ in calls:
            self._ids += 1
            ids.append(f"call_{self._ids}")
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            _tool_call(call_id, name, arguments) for call_id, (name, arguments) in zip(ids, calls, strict=True)]})
        outcomes = [await self.toolbox.execute(name, dict(arguments)) for name, arguments in calls]
        self.messages.extend({"role": "tool", "tool_call_id": call_id, "content": outcome.output}
                             for call_id, outcome in zip(ids, outcomes, strict=True))
        return outcomes

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The tool's output, after one retry when the first attempt failed or came back empty."""
        return (await self.calls([(name, arguments)]))[0]

    async def calls(self, calls: Sequence[Call]) -> list[str]:
        """Independent calls made together in one turn; each that failed or came back empty is retried in a turn of
        its own. Their outputs, in order."""
        outcomes = await self._turn(calls)
        for i, ((name, arguments), outcome) in enumerate(zip(calls, outcomes, strict=True)):
            if outcome.status != "ok" or not outcome.output.strip():
                again = self.retry(name, dict(arguments)) if self.retry else dict(arguments)
                outcomes[i] = (await self._turn([(name, again)]))[0]
        return [outcome.output for outcome in outcomes]

    def answer(self, text: str) -> list[dict[str, Any]]:
        self.messages.append({"role": "assistant", "content": text})
        return self.messages


# How a perfect agent solves a task: its calls through a Demonstration, then its answer.
Plan = Callable[[Demonstration], Awaitable[Any]]


def _tool_call(call_id: str, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(dict(arguments), ensure_ascii=False)}}


class _Decided(Exception):  # noqa: N818 - control flow, not an error: the plan reached the next turn
    def __init__(self, turn: dict[str, Any]) -> None:
        self.turn = turn


class Continuation(Demonstration):
    """A plan replayed against a conversation so far, to find its next assistant turn (the solver as a policy).

    Each tool call the plan makes runs on a fault-free toolbox; when the conversation already holds that result
    (a tool message of the same tool with the same content: whatever call wrote it), the step is done and the plan
    goes on with it. The first step whose result the conversation lacks is the next turn: a call as the plan writes
    it, which is also the retry after a failure (the agent loop lets a failed call be repeated as it was). When
    every step is done, the plan's answer is. Calls the policy made that the plan does not need are left aside.
    """

    def __init__(self, toolbox: TaskToolbox, messages: list[dict[str, Any]]) -> None:
        super().__init__(toolbox, "")
        self._results = [(name, content.strip()) for name, content in tool_results(messages)]
        self._used: set[int] = set()
        self._ids = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")

    async def _turn(self, calls: Sequence[Call]) -> list[ToolOutcome]:
        outcomes = [await self.toolbox.execute(name, dict(arguments)) for name, arguments in calls]
        missing = []
        for call, outcome in zip(calls, outcomes, strict=True):
            found = next((i for i, (tool, content) in enumerate(self._results) if i not in self._used
                          and tool == call[0] and content == outcome.output.strip()), None)
            if found is None:
                missing.append(call)
            else:
                self._used.add(found)
        if not missing:
            return outcomes
        # The turn makes together the calls of this step the conversation lacks.
        turn = []
        for name, arguments in missing:
            self._ids += 1
            turn.append(_tool_call(f"call_t{self._ids}", name, arguments))
        raise _Decided({"role": "assistant", "content": "", "tool_calls": turn})

    def answer(self, text: str) -> list[dict[str, Any]]:
        raise _Decided({"role": "assistant", "content": text})


def tool_results(messages: list[dict[str, Any]]) -> list[tuple[str | None, str]]:
    """Each tool message of a conversation as (the tool its call named, its text), in order."""
    names = {call.get("id"): (call.get("function") or {}).get("name")
             for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or []}
    return [(names.get(m.get("tool_call_id")), message_text(m.get("content")))
            for m in messages if m.get("role") == "tool"]


# -- the suite ------------------------------------------------------------------------------------


class Suite(ABC):
    """A named set of tasks with fixed splits, the tools they need, a verifier and a solver."""

    name: str
    system_prompt: str
    version: str = "1"  # bumped when the tools or the verifier change what an episode's outcome is

    @abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """The split's tasks, always the same ones in the same order."""

    @abstractmethod
    def draw(self, split: str, count: int, *, seed: int, min_faulted: int = 0, min_direct: int = 0) -> list[Task]:
        """``count`` fresh tasks from ``split``'s templates, drawn with ``seed`` (the gate's tasks), at least
        ``min_faulted`` of them with an injected fault where the split has faulted tasks and ``min_direct`` that no
        offered tool fits where it has such tasks; ``solve`` and ``verify`` know them."""

    @abstractmethod
    def registry(self) -> ToolRegistry:
        """Every tool any split offers, the test-only one included."""

    @abstractmethod
    def context(self) -> ToolContext:
        """The context the tools run with (creates what they need, e.g. the database, when missing)."""

    @abstractmethod
    def plan(self, task: Task) -> Plan:
        """How a perfect agent solves ``task``: calls through a ``Demonstration``, then its answer."""

    async def solve(self, task: Task) -> list[dict[str, Any]]:
        """A correct demonstration: OpenAI chat messages from the user prompt to the final answer."""
        demo = Demonstration(self.toolbox(task), task.prompt, retry=self.retry_arguments)
        await self.plan(task)(demo)
        return demo.messages

    async def next_turn(self, task: Task, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The correct next assistant turn from any conversation of ``task`` so far (``messages``: the policy's own
        turns, wrong ones included, and the tool results it got): retry a failed call, answer now, decline, or
        finish the plan from where it stands (``Continuation``)."""
        try:
            await self.plan(task)(Continuation(self.clean_toolbox(task), messages))
        except _Decided as decided:
            return decided.turn
        raise RuntimeError(f"the plan of {task.id} ended without an answer")

    def retry_arguments(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """How a demonstration writes the retry of a failed call (the same call by default)."""
        return arguments

    def toolbox(self, task: Task) -> TaskToolbox:
        """A fresh toolbox for one episode of ``task``: its tools, bound to ``context()``, fault injected."""
        return TaskToolbox(Toolbox(self.registry(), self.context(), task.tools), task.fault)

    def clean_toolbox(self, task: Task) -> TaskToolbox:
        """``task``'s tools without its fault: what each call gives when nothing fails."""
        return TaskToolbox(Toolbox(self.registry(), self.context(), task.tools))

    def verify(self, task: Task, final: str | None, messages: list[dict[str, Any]]) -> bool:
        """Whether the episode succeeded, judged on its final answer (see ``check_final``); where no offered tool
        fits, also on making no call (an invalid or refused one included)."""
        if task.direct and any(m.get("tool_calls") for m in messages if m.get("role") == "assistant"):
            return False
        return check_final(task.expected, final, task.prompt, self.alternatives(task))

    def alternatives(self, task: Task) -> tuple[str, ...]:
        """The other values a task's string answer could have been (naming one of them as well fails)."""
        return ()

    def test_only_phrasings(self) -> tuple[str, ...]:
        """Text fragments that only test prompts contain (one per test-only phrasing)."""
        return ()

    def all_tasks(self) -> list[Task]:
        return [t for split in SPLITS for t in self.tasks(split)]

    def task(self, task_id: str) -> Task:
        for t in self.all_tasks():
            if t.id == task_id:
                return t
        raise KeyError(f"no task {task_id!r} in suite {self.name!r}")

    @staticmethod
    def check_split(split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
