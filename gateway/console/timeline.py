"""A trajectory as the console's timeline shows it: one entry per model call, in order, holding what that step
sent and got back, the tool calls it made (with their validation errors and results), the loop's transitions, its
process rewards, and its tokens, latency, backend and adapter. Pure: the read model in, plain values out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replay.model import Feedback, ModelCall, RunEvent, ToolCall, Trajectory, content_text

# A message longer than this shows its first part, the rest a click away.
COLLAPSE_CHARS = 600


@dataclass
class Message:
    role: str
    text: str
    tool_calls: list[dict[str, str]]  # name, arguments
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def long(self) -> bool:
        return len(self.text) > COLLAPSE_CHARS

    @property
    def preview(self) -> str:
        return self.text[:COLLAPSE_CHARS // 2]


@dataclass
class Step:
    seq: int
    purpose: str  # step | summary
    call: ModelCall
    sent: list[Message]  # what is new in this call's request (the whole request on the first call)
    request: list[Message]  # the request's messages, all of them
    replies: list[Message]
    tool_calls: list[ToolCall] = field(default_factory=list)
    events: list[RunEvent] = field(default_factory=list)
    rewards: list[Feedback] = field(default_factory=list)

    @property
    def invalid_calls(self) -> int:
        return sum(not t.valid for t in self.tool_calls)


def message(raw: Any) -> Message:
    if not isinstance(raw, dict):
        return Message(role="?", text=str(raw), tool_calls=[])
    calls = []
    for call in raw.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append({"name": str(function.get("name") or ""), "arguments": str(function.get("arguments") or "")})
    return Message(role=str(raw.get("role") or "?"), text=content_text(raw.get("content")) or "", tool_calls=calls,
                   tool_call_id=raw.get("tool_call_id"), name=raw.get("name"))


def _new_messages(call: ModelCall) -> list[Any]:
    """The messages a later call adds: those after its request's last assistant turn (the tools' results, the user's
    next message); a first call's whole request."""
    messages = call.messages
    if call.seq == 0:
        return messages
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"), default=-1)
    return messages[last + 1:]


def steps(trajectory: Trajectory) -> list[Step]:
    out = []
    for call in trajectory.calls:
        choices = (call.response or {}).get("choices") or []
        out.append(Step(seq=call.seq, purpose=call.purpose, call=call, sent=[message(m) for m in _new_messages(call)],
                        request=[message(m) for m in call.messages],
                        replies=[message(c.get("message")) for c in choices if isinstance(c, dict)]))
    by_seq = {s.seq: s for s in out}
    for tool_call in trajectory.tool_calls:
        if tool_call.step in by_seq:
            by_seq[tool_call.step].tool_calls.append(tool_call)
    for seq, events in _events_by_call(trajectory)[0].items():
        by_seq[seq].events.extend(events)
    for row in trajectory.feedback:
        if row.model_call_seq is not None and row.model_call_seq in by_seq:
            by_seq[row.model_call_seq].rewards.append(row)
    return out


def loose_events(trajectory: Trajectory) -> list[RunEvent]:
    """Transitions before the first model call."""
    return _events_by_call(trajectory)[1]


# The transitions that make a model call: each call's own transitions are those from its opener to the next one.
OPENERS = ("CALL_MODEL", "SUMMARIZE")


def _events_by_call(trajectory: Trajectory) -> tuple[dict[int, list[RunEvent]], list[RunEvent]]:
    """The run's transitions by the model call they belong to, and those before the first call. An event's ``step``
    counts the steps taken when it happened, not a model call's seq (a call's reply is parsed and its tools run one
    step later than the call was made; a summary call takes no step): the order the loop wrote them in places them,
    each call opened by its CALL_MODEL, or a summary's SUMMARIZE."""
    seqs = [c.seq for c in trajectory.calls]
    by_seq: dict[int, list[RunEvent]] = {seq: [] for seq in seqs}
    before: list[RunEvent] = []
    at = -1
    for event in trajectory.events:
        if event.state in OPENERS and at + 1 < len(seqs):
            at += 1
        (by_seq[seqs[at]] if at >= 0 else before).append(event)
    return by_seq, before


def whole_feedback(trajectory: Trajectory) -> list[Feedback]:
    """Feedback on the trajectory as a whole (not on one step)."""
    return [f for f in trajectory.feedback if f.model_call_seq is None]
