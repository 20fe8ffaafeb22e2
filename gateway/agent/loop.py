"""The agent loop: a state machine whose every transition is an event.

``CALL_MODEL → PARSE → VALIDATE → EXECUTE → OBSERVE → (SUMMARIZE) → CALL_MODEL … → FINAL | TERMINATED``

``step()`` is one model call and what follows from it; ``run()`` repeats it until the model answers
without calling a tool or a limit stops it. Stops are ``Termination`` exceptions carrying their named
reason. The state (messages, spent budgets, counters) is persisted after every step, so a run can be
inspected, replayed or resumed from the store.

A loop that may wait (``hold_for_approval``) holds calls to tools that need a person's approval: the run
pauses in ``pending_approval`` (state ``AWAIT_APPROVAL``) with the calls in ``RunState.pending``, and
``run(decisions)`` later runs the approved ones, tells the model about the denied ones, and goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import structlog

from gateway.agent import context as ctx
from gateway.agent.limits import Budget, Limiter, Limits, Termination, call_signature
from gateway.agent.parsing import parse_message
from gateway.agent.validation import CheckedCall, check_call
from gateway.backends.base import Backend, BackendError, ChatRequest, ChatResult
from gateway.budget import BudgetExhausted, cap_completion
from gateway.config import ProfileSettings
from gateway.quotas.admission import Hold, Meter, QuotaExceeded
from replay.approvals import APPROVED, EXPIRED
from replay.records import new_id
from replay.vocabulary import BACKEND_ERROR, BUDGET_EXCEEDED, CLIENT_DISCONNECTED, DEADLINE, MAX_TOTAL_TOKENS
from tools.executor import ToolOutcome
from tools.spec import ToolSpec

log = structlog.get_logger()

# States of the machine, as written to the events table.
CALL_MODEL, PARSE, VALIDATE, EXECUTE, OBSERVE, SUMMARIZE = (
    "CALL_MODEL", "PARSE", "VALIDATE", "EXECUTE", "OBSERVE", "SUMMARIZE")
FINAL, TERMINATED, ERROR = "FINAL", "TERMINATED", "ERROR"
AWAIT_APPROVAL, APPROVAL = "AWAIT_APPROVAL", "APPROVAL"
USER_TURN = "USER_TURN"  # a conversation's next message joined the run

APPROVAL_NEEDED = ("Not run: {name} needs a person's approval, and no approver is available. Continue without it "
                   "or say what you would have done.")
DENIED_NOTE = ("Denied: a person did not allow this call to {name}{reason}. Do not try it again; continue "
               "without it.")
EXPIRED_NOTE = "Not run: nobody approved this call to {name} in time. Continue without it."
WRAP_UP = ("You must stop now ({detail}). Do not call any tools. Give your best final answer from what you "
           "have so far, and say plainly what you could not do.")


class AllowedTools(Protocol):
    """The tools one run may use, as the loop calls them (``tools.toolbox.Toolbox``, or a task's own)."""

    def schemas(self) -> dict[str, dict[str, Any] | None]: ...

    def get(self, name: str) -> ToolSpec | None: ...

    def openai_tools(self) -> list[dict[str, Any]]: ...

    async def execute(self, name: str, arguments: dict[str, Any]) -> ToolOutcome: ...


@dataclass
class Profile:
    name: str
    model: str
    system_prompt: str = ProfileSettings.default_of("system_prompt")
    tools: list[str] = field(default_factory=lambda: ProfileSettings.default_of("tools"))
    limits: Limits = field(default_factory=Limits)
    context_budget_tokens: int = ProfileSettings.default_of("context_budget_tokens")  # 0: never summarize
    keep_last_turns: int = ProfileSettings.default_of("keep_last_turns")
    temperature: float | None = ProfileSettings.default_of("temperature")
    max_tokens: int | None = ProfileSettings.default_of("max_tokens")
    constrain_tool_calls: bool = ProfileSettings.default_of("constrain_tool_calls")


@dataclass
class StepEvent:
    """A state the loop passed through in a step, as it is written to the ``events`` table."""

    step: int
    state: str
    data: dict[str, Any]
    created_at: float = field(default_factory=time.time)


@dataclass
class RunState:
    """Everything needed to continue a run; persisted as JSON after every step."""

    run_id: str
    profile: str
    messages: list[dict[str, Any]]
    budget: Budget = field(default_factory=Budget)
    status: str = "running"  # running | completed | terminated | error | interrupted | pending_approval
    termination_reason: str | None = None
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    final: str | None = None
    error: str | None = None
    model_calls: int = 0  # every backend call, summaries and wrap-ups included
    pending: list[dict[str, Any]] = field(default_factory=list)  # held calls: id (approval), call_id, name, arguments
    paused_at: float | None = None

    def add_user_turn(self, text: str) -> None:
        """A conversation goes on: the next user message, with the per-turn limits counting afresh."""
        self.messages.append({"role": "user", "content": text})
        self.status, self.termination_reason, self.final, self.error = "running", None, None, None
        self.budget.new_turn()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        return cls(**{**data, "budget": Budget(**data["budget"])})

    def harness(self) -> dict[str, Any]:
        """The ``harness`` object every surface returns; its field names are a public contract."""
        b = self.budget
        return {"trajectory_id": self.run_id, "status": self.status, "termination_reason": self.termination_reason,
                "steps": b.steps, "tool_calls": self.tool_calls, "invalid_tool_calls": self.invalid_tool_calls,
                "usage": {"prompt_tokens": b.prompt_tokens, "completion_tokens": b.completion_tokens,
                          "total_tokens": b.total_tokens}}


@dataclass
class StepRecord:
    """What one step produced, for the recorder to persist in one commit."""

    step: int
    request: dict[str, Any] | None = None  # the body as sent to the backend
    result: ChatResult | None = None
    error: str | None = None
    latency_ms: float = 0.0
    purpose: str = "step"  # step | summary | wrap_up
    calls: list[tuple[CheckedCall, ToolOutcome | None]] = field(default_factory=list)
    events: list[StepEvent] = field(default_factory=list)
    approvals: list[dict[str, Any]] = field(default_factory=list)  # calls held in this step
    decided: list[tuple[str, ToolOutcome]] = field(default_factory=list)  # held calls' outcomes, by call id


class Recorder(Protocol):
    async def step(self, state: RunState, record: StepRecord) -> None: ...


class AgentLoop:
    def __init__(self, *, profile: Profile, backend: Backend, toolbox: AllowedTools, recorder: Recorder,
                 state: RunState, token_counter: ctx.TokenCounter | None = None,
                 on_event: Callable[[StepEvent], None] | None = None, hold_for_approval: bool = False,
                 tenant: str | None = None, meter: Meter | None = None) -> None:
        self.profile = profile
        self.tenant = tenant  # whose run it is: the backend keeps its cached prompts apart from other tenants
        self.meter = meter  # the limits of the key and tenant the run counts against
        self.backend = backend
        self.toolbox = toolbox
        self.recorder = recorder
        self.state = state
        self.limiter = Limiter(profile.limits, state.budget)
        self.count_tokens = token_counter or ctx.approximate_tokens
        self.on_event = on_event
        self.hold_for_approval = hold_for_approval
        # How a cancelled run is recorded: a streaming client that left, or a gateway shutting down.
        self.cancelled_as: tuple[str, str | None] = ("terminated", CLIENT_DISCONNECTED)

    # -- the run ----------------------------------------------------------------------------------

    async def run(self, decisions: dict[str, dict[str, Any]] | None = None) -> RunState:
        """Run until the model answers, a limit stops it, or calls wait for approval. ``decisions`` (approval id
        -> ``{"status", "reason"}``) settle the calls a paused run holds before it goes on."""
        state = self.state
        try:
            if decisions is not None:
                await self._settle(decisions)
            while state.status == "running":
                await self.step()
        except Termination as stop:
            await self._terminate(stop)
        except asyncio.CancelledError:
            state.status, state.termination_reason = self.cancelled_as
            await asyncio.shield(self._persist(StepRecord(step=state.budget.steps, events=[
                self._event(TERMINATED, reason=state.termination_reason or state.status)])))
            raise
        return state

    async def step(self) -> None:
        state, n = self.state, self.state.budget.steps
        record = StepRecord(step=n)
        self.limiter.before_model_call()
        await self._maybe_summarize(record)
        body = self._body(self.profile.tools and self.toolbox.openai_tools())
        result = await self._call_model(record, body, CALL_MODEL)
        message = result.message or {"role": "assistant"}

        self._emit(record, PARSE)
        parsed = parse_message(message)
        if not parsed.calls:
            state.final = parsed.content or ""
            state.messages.append({"role": "assistant", "content": state.final})
            state.status = "completed"
            self._emit(record, FINAL, content=state.final)
            await self._persist(record)
            return

        self._emit(record, VALIDATE, calls=len(parsed.calls))
        schemas = self.toolbox.schemas()
        checked = [check_call(c.id, c.name, c.arguments, schemas, already_repaired=c.repaired)
                   for c in parsed.calls]
        state.messages.append({"role": "assistant", "content": parsed.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
            for c in checked]})
        state.tool_calls += len(checked)

        stop: Termination | None = None
        held: set[str] = set()
        refusals: dict[str, str] = {}
        signatures: dict[str, str] = {}  # call id -> signature
        for c in checked:
            if not c.valid:
                continue
            sig = signatures[c.id] = call_signature(c.name, c.arguments)
            try:
                refusal = self.limiter.check_repeat(sig, c.name)
            except Termination as exc:
                stop = stop or exc
                refusal = "Refused: the same call again. The run is stopping."
            if refusal:
                refusals[c.id] = refusal
            elif self.hold_for_approval and self._needs_approval(c.name):
                held.add(c.id)
        if stop is not None:
            held.clear()
        runnable = [c for c in checked if c.valid and c.id not in refusals and c.id not in held]
        self._emit(record, EXECUTE, calls=[{"id": c.id, "name": c.name, "arguments": c.arguments}
                                           for c in runnable])
        outcomes = await asyncio.gather(*[self._execute(c) for c in runnable]) if stop is None else []
        by_id = {c.id: o for c, o in zip(runnable, outcomes, strict=False)}

        nudges = []
        for c in checked:
            if not c.valid:
                state.invalid_tool_calls += 1
                note = f"Invalid call to {c.name}: {c.error}. Fix the call and try again."
                outcome = ToolOutcome("invalid", note, 0.0)
            elif c.id in refusals:
                outcome = ToolOutcome("denied", refusals[c.id], 0.0)
            elif c.id in held:  # its tool message comes with the decision
                approval = {"id": new_id(), "call_id": c.id, "name": c.name, "arguments": c.arguments}
                state.pending.append(approval)
                record.approvals.append(approval)
                record.calls.append((c, ToolOutcome("pending_approval", "", 0.0)))
                continue
            else:
                outcome = by_id.get(c.id) or ToolOutcome("denied", "Not run: the run is stopping.", 0.0)
            record.calls.append((c, outcome))
            state.messages.append({"role": "tool", "tool_call_id": c.id, "content": outcome.output})
            if outcome.status in ("ok", "error", "timeout", "invalid"):
                try:
                    nudge = self.limiter.tool_result(c.name, outcome.status == "ok")
                except Termination as exc:
                    stop = stop or exc
                    nudge = None
                if nudge:
                    nudges.append(nudge)
        self._emit(record, OBSERVE, results=[{"id": c.id, "name": c.name, "status": o.status,
                                              "output": o.output[:500]} for c, o in record.calls])
        if nudges:
            state.messages.append({"role": "user", "content": "\n".join(nudges)})
        # A call that failed (error, timeout, empty result) may be retried as it was: that is recovering.
        failed = {signatures[c.id] for c, o in record.calls if c.id in signatures and (
            o.status in ("error", "timeout") or (o.status == "ok" and not o.output.strip()))}
        self.limiter.end_step(list(signatures.values()), failed=failed)
        if state.pending:
            state.status, state.paused_at = "pending_approval", time.time()
            self._emit(record, AWAIT_APPROVAL, approvals=list(record.approvals))
        await self._persist(record)
        if stop is not None:
            raise stop

    async def _settle(self, decisions: dict[str, dict[str, Any]]) -> None:
        """Run the approved held calls, refuse the others, and put their results where the calls were made."""
        state = self.state
        record = StepRecord(step=state.budget.steps)
        results, stop = [], None
        for held in state.pending:
            decision = decisions[held["id"]]
            if decision["status"] == APPROVED:
                outcome = await self.toolbox.execute(held["name"], held["arguments"])
            elif decision["status"] == EXPIRED:
                outcome = ToolOutcome("denied", EXPIRED_NOTE.format(name=held["name"]), 0.0)
            else:
                reason = f" ({decision['reason']})" if decision.get("reason") else ""
                outcome = ToolOutcome("denied", DENIED_NOTE.format(name=held["name"], reason=reason), 0.0)
            record.decided.append((held["call_id"], outcome))
            results.append({"role": "tool", "tool_call_id": held["call_id"], "content": outcome.output})
            self._emit(record, APPROVAL, id=held["id"], name=held["name"], decision=decision["status"],
                       status=outcome.status, output=outcome.output[:500])
            if outcome.status in ("ok", "error", "timeout"):
                try:
                    self.limiter.tool_result(held["name"], outcome.status == "ok")
                except Termination as exc:
                    stop = stop or exc
        state.messages[:] = ctx.with_tool_results(state.messages, results)
        if state.paused_at is not None:  # waiting for a person is not the run's time
            state.budget.started_at += time.time() - state.paused_at
        state.pending, state.paused_at, state.status = [], None, "running"
        await self._persist(record)
        if stop is not None:
            raise stop

    # -- pieces -----------------------------------------------------------------------------------

    def _body(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.profile.model, "messages": list(self.state.messages)}
        if tools:
            body["tools"] = tools
            if self.profile.constrain_tool_calls:
                body["constrain_tool_calls"] = True
        if self.profile.temperature is not None:
            body["temperature"] = self.profile.temperature
        if self.profile.max_tokens is not None:
            body["max_tokens"] = self.profile.max_tokens
        return body

    async def _call_model(self, record: StepRecord, body: dict[str, Any], state_name: str) -> ChatResult:
        hold = await self._admit(body, self._hold_budget(body))
        self._emit(record, state_name, messages=len(body["messages"]))
        record.request = body
        started = time.perf_counter()
        timeout = self.limiter.seconds_left()
        try:
            result = await asyncio.wait_for(self._metered_chat(body, hold), timeout)
        except TimeoutError:
            record.error = "the deadline passed during the model call"
            await self._persist(record)
            raise Termination(DEADLINE, record.error) from None
        except BackendError as exc:
            record.error = exc.message
            record.latency_ms = (time.perf_counter() - started) * 1000
            self.state.status, self.state.termination_reason, self.state.error = "error", BACKEND_ERROR, exc.message
            self._emit(record, ERROR, error=exc.message)
            await self._persist(record)
            raise Termination(BACKEND_ERROR, exc.message) from None
        record.latency_ms = (time.perf_counter() - started) * 1000
        record.result = result
        self.limiter.spent(result.response.get("usage"))
        return result

    def _hold_budget(self, body: dict[str, Any]) -> int | None:
        """Before a call: its completion capped so that the run cannot spend past its token budget, or a
        ``Termination`` when not one completion token fits. The prompt's tokens, where they were counted."""
        remaining = self.limiter.tokens_left()
        if remaining is None:
            return None
        prompt = self.count_tokens(body["messages"], body.get("tools"))
        try:
            cap_completion(body, remaining=remaining, prompt_tokens=prompt)
        except BudgetExhausted as exc:
            raise Termination(MAX_TOTAL_TOKENS, f"{exc} (max_total_tokens {self.limiter.limits.max_total_tokens})") \
                from None
        return prompt

    async def _admit(self, body: dict[str, Any], prompt: int | None) -> Hold | None:
        """A model call held within the limits of the key (and tenant) that started the run: a run past them ends
        ``budget_exceeded``."""
        if self.meter is None:
            return None
        try:
            return await self.meter.admit(body, lambda: prompt if prompt is not None else self.count_tokens(
                body["messages"], body.get("tools")))
        except QuotaExceeded as exc:
            raise Termination(BUDGET_EXCEEDED, str(exc)) from None

    async def _metered_chat(self, body: dict[str, Any], hold: Hold | None) -> ChatResult:
        """The call, and its hold settled with what it spent (nothing, when it failed)."""
        usage = None
        try:
            result = await self.backend.chat(ChatRequest(body=body, model=self.profile.model, tenant=self.tenant))
            usage = result.response.get("usage")
            return result
        finally:
            if self.meter is not None:
                await self.meter.settle(hold, usage)

    def _needs_approval(self, name: str) -> bool:
        spec = self.toolbox.get(name)
        return spec is not None and spec.requires_approval

    async def _execute(self, call: CheckedCall) -> ToolOutcome:
        assert call.arguments is not None
        if self._needs_approval(call.name):
            # A loop that cannot wait (a chat completion in flight) refuses: never run unapproved.
            return ToolOutcome("denied", APPROVAL_NEEDED.format(name=call.name), 0.0)
        return await self.toolbox.execute(call.name, call.arguments)

    async def _maybe_summarize(self, record: StepRecord) -> None:
        budget = self.profile.context_budget_tokens
        if not budget or self.count_tokens(self.state.messages, None) <= budget:
            return
        split = ctx.split_for_summary(self.state.messages, self.profile.keep_last_turns)
        if split is None:
            return
        self._emit(record, SUMMARIZE, replaced=len(split.middle))
        summary_record = StepRecord(step=record.step, purpose="summary")
        body = {"model": self.profile.model, "messages": ctx.summary_request(split.middle), "max_tokens": 256}
        summary_record.request = body
        try:
            result = await self._metered_chat(body, await self._admit(body, self._hold_budget(body)))
            summary_record.result = result
            usage = result.response.get("usage") or {}
            self.state.budget.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.state.budget.completion_tokens += int(usage.get("completion_tokens") or 0)
            text = result.message.get("content") or ""
        except (BackendError, Termination) as exc:  # no model summary: the extractive one below stands in
            summary_record.error = str(exc) if isinstance(exc, Termination) else exc.message
            text = ""
        if not text.strip():
            text = ctx.extractive_summary(split.middle)
        await self.recorder.step(self.state, summary_record)
        self.state.messages = split.head + [ctx.summary_message(text)] + split.tail

    async def _terminate(self, stop: Termination) -> None:
        state = self.state
        if state.status != "error":
            state.status, state.termination_reason = "terminated", stop.reason
        record = StepRecord(step=state.budget.steps, purpose="wrap_up")
        if state.status == "terminated" and self.limiter.can_wrap_up():
            state.messages.append({"role": "user", "content": WRAP_UP.format(detail=stop.detail)})
            try:
                result = await self._call_model(record, self._body(None), CALL_MODEL)
                state.final = parse_message(result.message).content or ""
                state.messages.append({"role": "assistant", "content": state.final})
            except Termination:
                state.status, state.termination_reason = "terminated", stop.reason
        self._emit(record, TERMINATED, reason=stop.reason, detail=stop.detail)
        await self._persist(record)

    def _event(self, state_name: str, **data: Any) -> StepEvent:
        return StepEvent(step=self.state.budget.steps, state=state_name, data=data)

    def _emit(self, record: StepRecord, state_name: str, **data: Any) -> None:
        event = self._event(state_name, **data)
        record.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    async def _persist(self, record: StepRecord) -> None:
        await self.recorder.step(self.state, record)
