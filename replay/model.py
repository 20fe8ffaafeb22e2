"""The read model: a stored trajectory with its model calls, tool calls, events, feedback and agent run.

Read once by ``TrajectoryStore.get_trajectory`` and consumed as is by the reward signals, RL, evaluation,
the API and the command line. ``format`` names the API a trajectory's calls came through: ``chat`` (Chat
Completions, and the Responses API translated for a chat backend), ``anthropic`` (the Messages API) or
``responses`` (the Responses API passed through to a Responses-native upstream). Whatever the format,
``ModelCall.request`` and its replies are Chat Completions messages, which every reader (rewards, export,
training) takes; a call that came through another API also keeps its exchange as it came, ``ModelCall.native``
(``{"api", "request", "response"}``: the Messages API request and the Message answered, thinking signatures and
all; the Responses request and response, reasoning items and their ``encrypted_content`` and all, which
``Trajectory.items`` lays out as the session's items). The formats ``completions`` and ``embeddings`` (legacy text
completions, embeddings) hold no conversation: their one call has no messages and its exchange in ``native`` alone
(an embedding's vectors left out), so exports and training pass them by and the reward engine leaves them
unscored.

A model call is read in two depths: ``StoredCall``, as the store holds it (message bodies by key, token ids
packed), and ``ModelCall``, whole (``StoredCall.to_model_call``: bodies in place, columns unpacked). Readers of
one trajectory take it whole; the bulk export takes ``StoredCall`` and splices the stored bodies' bytes without
decoding them (over ten thousand trajectories a second, where making each whole runs at about five hundred).
``stats`` aggregates the same tables in SQL, over the vocabulary in ``replay.vocabulary``.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from replay.records import unpack
from replay.vocabulary import REFUSED_STATUSES

CHAT = "chat"
ANTHROPIC = "anthropic"
RESPONSES = "responses"  # the Responses API passed through to a Responses-native upstream
# Calls passed through without a conversation: a raw prompt completed, texts embedded. Recorded without messages (so
# exports and training, which read messages and replies, pass them by) and whole in ``ModelCall.native``.
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
# The formats whose calls hold messages to learn from and reward.
CONVERSATIONS = frozenset({CHAT, ANTHROPIC, RESPONSES})


def content_text(content: Any) -> str | None:
    """A message's content as text: a string as is, content parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content)


def _same_item(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k not in ("id", "status")} == \
        {k: v for k, v in b.items() if k not in ("id", "status")}


@dataclass(slots=True, kw_only=True)
class _CallColumns:
    """What a model call's two depths share: the columns read as they are stored."""

    backend: str | None = None
    model: str | None = None
    adapter: str | None = None
    stream: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    ttft_ms: float | None = None


@dataclass(slots=True)
class ModelCall(_CallColumns):
    """One backend call, as sent and as answered."""

    id: str
    seq: int
    created_at: float
    status: str  # ok | error | client_disconnected
    request: dict[str, Any]  # the exact request as sent: messages, tools and every other parameter
    response: dict[str, Any] | None  # with each choice's message
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[list[int]] | None = None  # per choice
    # Per choice and completion token: the log-probability under the model itself (temperature 1, nothing masked:
    # what KL and perplexity compare), and under the distribution it was sampled from (temperature, top-p,
    # penalties, any grammar mask: what an importance ratio compares; 0 for a greedy choice).
    completion_logprobs: list[list[float]] | None = None
    completion_sampled_logprobs: list[list[float]] | None = None
    native: dict[str, Any] | None = None  # {"api", "request", "response"}: the exchange as it came, if not chat

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.request.get("messages") or []

    @property
    def purpose(self) -> str:
        """``step`` (a model call that acts) or ``summary`` (one that compacts the context)."""
        return self.request.get("purpose", "step")

    @property
    def reply(self) -> dict[str, Any] | None:
        """The first choice's message."""
        choices = (self.response or {}).get("choices") or []
        return choices[0].get("message") if choices else None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "seq": self.seq, "created_at": self.created_at, "backend": self.backend,
                "model": self.model, "adapter": self.adapter, "stream": self.stream, "status": self.status,
                "error": self.error, "request": self.request, "response": self.response,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "latency_ms": self.latency_ms, "ttft_ms": self.ttft_ms, "prompt_token_ids": self.prompt_token_ids,
                "completion_token_ids": self.completion_token_ids, "completion_logprobs": self.completion_logprobs,
                "completion_sampled_logprobs": self.completion_sampled_logprobs, "native": self.native}


@dataclass(slots=True)
class StoredCall(_CallColumns):
    """A model call as the store holds it: its messages, tool specs and replies as keys of bodies stored once each
    (the ``blobs`` table, shared by every call that sent them), its parameters and response as JSON text, its token
    ids and log-probabilities packed. ``to_model_call`` turns it into a ``ModelCall``."""

    trajectory_id: str
    id: str
    seq: int
    created_at: float
    status: str
    request_keys: list[str]
    tools_key: str | None
    reply_keys: list[str]  # per choice
    params: str | None
    response: str | None
    packed_prompt_ids: bytes | None = None
    packed_completion_ids: bytes | None = None
    packed_logprobs: bytes | None = None
    packed_sampled_logprobs: bytes | None = None

    @property
    def body_keys(self) -> set[str]:
        """Every body this call refers to."""
        return {*self.request_keys, *self.reply_keys, *([self.tools_key] if self.tools_key else [])}

    @property
    def reply_key(self) -> str | None:
        """The first choice's message body."""
        return self.reply_keys[0] if self.reply_keys else None

    @property
    def declared_purpose(self) -> str | None:
        """The purpose its request declared (``summary``), ``None`` for a plain step."""
        if not self.params or '"purpose"' not in self.params:
            return None
        return orjson.loads(self.params).get("purpose")

    @property
    def finish_reason(self) -> str | None:
        """The first choice's, read without parsing the whole response (orjson's compact JSON)."""
        if not self.response:
            return None
        at = self.response.find('"finish_reason":"')
        if at < 0:
            return None
        start = at + len('"finish_reason":"')
        return self.response[start:self.response.find('"', start)]

    def first_completion_ids(self) -> bytes | None:
        """The first choice's token ids as JSON bytes, cut out of the packed ``[[ids of choice 0], ...]``."""
        return _first_choice(self.packed_completion_ids)

    def first_sampled_logprobs(self) -> bytes | None:
        """The first choice's log-probabilities under the distribution it was sampled from, as JSON bytes."""
        return _first_choice(self.packed_sampled_logprobs)

    def to_model_call(self, bodies: Mapping[str, Any]) -> ModelCall:
        """This call with its bodies (decoded, by key) in place and its packed columns unpacked."""
        response = orjson.loads(self.response) if self.response else None
        if response is not None:
            for choice, key in zip(response.get("choices", []), self.reply_keys, strict=False):
                choice["message"] = bodies.get(key)
        return ModelCall(
            id=self.id, seq=self.seq, created_at=self.created_at, status=self.status,
            request={"messages": [bodies.get(k) for k in self.request_keys],
                     "tools": bodies.get(self.tools_key) if self.tools_key else None,
                     **orjson.loads(self.params or "{}")},
            response=response, **{f.name: getattr(self, f.name) for f in fields(_CallColumns)},
            prompt_token_ids=unpack(self.packed_prompt_ids),
            completion_token_ids=unpack(self.packed_completion_ids),
            completion_logprobs=unpack(self.packed_logprobs),
            completion_sampled_logprobs=unpack(self.packed_sampled_logprobs))


def _first_choice(packed: bytes | None) -> bytes | None:
    """Choice 0's list out of a packed ``[[... of choice 0], ...]``, as JSON bytes."""
    if packed is None:
        return None
    values = zlib.decompress(packed)
    if values.startswith(b"[[") and b"null" not in values:
        return values[1:values.index(b"]") + 1]  # lists of numbers nest nothing: the first "]" closes choice 0
    per_choice = orjson.loads(values)
    return orjson.dumps(per_choice[0]) if per_choice and per_choice[0] is not None else None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call, with the result the model saw."""

    step: int  # the model call's seq
    call_id: str | None
    name: str | None
    arguments: str  # raw, as the model wrote them
    valid: bool
    status: str  # ok | error | timeout | invalid | denied | returned | retried | pending_approval
    result: str | None  # the agent's tool output, or (proxy mode) the client's tool message
    parsed: bool = True
    repaired: bool = False
    validation_error: str | None = None
    duration_ms: float | None = None
    created_at: float = 0.0

    @property
    def succeeded(self) -> bool:
        """A result the model could use: ran fine, or (proxy mode) the client sent back its result."""
        return self.valid and (self.status == "ok" or (self.status == "returned" and self.result is not None))

    @property
    def refused(self) -> bool:
        """Invalid (bad arguments, unknown or forbidden tool) or refused (a repeat, an unapproved tool)."""
        return not self.valid or self.status in REFUSED_STATUSES

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "call_id": self.call_id, "name": self.name, "arguments": self.arguments,
                "valid": self.valid, "status": self.status, "result": self.result, "parsed": self.parsed,
                "repaired": self.repaired, "validation_error": self.validation_error,
                "duration_ms": self.duration_ms, "created_at": self.created_at}


@dataclass(frozen=True, slots=True)
class Feedback:
    """A reward or a label, for the whole trajectory or (``model_call_seq``) one step."""

    source: str  # verifier | user | reward_engine | ...
    name: str
    value: float | None
    label: str | None
    comment: str | None = None
    model_call_seq: int | None = None
    created_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "name": self.name, "value": self.value, "label": self.label,
                "comment": self.comment, "model_call_seq": self.model_call_seq, "created_at": self.created_at}


@dataclass(frozen=True, slots=True)
class RunEvent:
    """A state an agent run passed through, as read from the ``events`` table (the loop writes a ``StepEvent``)."""

    step: int
    state: str
    data: Any
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state, "data": self.data, "created_at": self.created_at}


@dataclass(frozen=True, slots=True)
class AgentRun:
    """The agent run a trajectory is, when it is one."""

    profile: str
    status: str
    termination_reason: str | None
    steps: int
    state: dict[str, Any]  # the resumable run state (messages, budget, final answer, ...)
    result: dict[str, Any] | None
    created_at: float
    updated_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "status": self.status, "termination_reason": self.termination_reason,
                "steps": self.steps, "result": self.result, "created_at": self.created_at,
                "updated_at": self.updated_at}


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A trajectory; ``calls`` and what follows are empty in a listing, which reads the trajectory alone."""

    id: str
    source: str
    status: str
    created_at: float
    updated_at: float
    tenant: str | None = None
    key_id: str | None = None
    session_key: str | None = None
    requested_model: str | None = None
    base_model: str | None = None
    adapter: str | None = None
    adapter_version: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    parent_id: str | None = None
    termination_reason: str | None = None
    message_count: int = 0
    n_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    final_reward: float | None = None
    metadata: dict[str, Any] | None = None
    format: str = CHAT
    calls: list[ModelCall] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    events: list[RunEvent] = field(default_factory=list)
    feedback: list[Feedback] = field(default_factory=list)  # oldest first
    run: AgentRun | None = None

    @property
    def steps(self) -> list[ModelCall]:
        """The model calls that acted (summaries excluded)."""
        return [c for c in self.calls if c.purpose != "summary"]

    def summary(self) -> dict[str, Any]:
        """The trajectory's own fields, as a listing shows them."""
        return {"id": self.id, "source": self.source, "tenant": self.tenant, "key_id": self.key_id,
                "session_key": self.session_key, "requested_model": self.requested_model,
                "base_model": self.base_model, "adapter": self.adapter, "adapter_version": self.adapter_version,
                "task_id": self.task_id, "group_id": self.group_id, "parent_id": self.parent_id,
                "status": self.status, "termination_reason": self.termination_reason,
                "message_count": self.message_count, "n_calls": self.n_calls, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "latency_ms": self.latency_ms,
                "final_reward": self.final_reward, "metadata": self.metadata, "created_at": self.created_at,
                "updated_at": self.updated_at}

    def items(self) -> list[dict[str, Any]]:
        """A ``responses`` trajectory as the items its session went through, in order: each call's input items not
        already seen, then its output items. A compacted history starts over, after the compaction call's output;
        an item sent back matches the one answered whatever its ``id`` and ``status``, which clients may drop."""
        items: list[dict[str, Any]] = []
        seen: list[dict[str, Any]] = []
        for call in self.calls:
            native = call.native or {}
            if native.get("api") != RESPONSES:
                continue
            given = (native.get("request") or {}).get("input")
            given = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
            inputs = [i for i in given or () if isinstance(i, dict)]
            output = [i for i in (native.get("response") or {}).get("output") or () if isinstance(i, dict)]
            known = len(seen) <= len(inputs) and all(map(_same_item, seen, inputs))
            items += (inputs[len(seen):] if known else inputs) + output
            seen = inputs + output
        return items

    def to_dict(self) -> dict[str, Any]:
        """Everything, as the API and ``harness show`` give it (a ``responses`` trajectory's ``items`` too)."""
        extra = {"items": self.items()} if self.format == RESPONSES else {}
        return {**self.summary(), "format": self.format, **extra, "calls": [c.to_dict() for c in self.calls],
                "tool_calls": [t.to_dict() for t in self.tool_calls], "events": [e.to_dict() for e in self.events],
                "feedback": [f.to_dict() for f in self.feedback],
                "run": self.run.to_dict() if self.run else None}
