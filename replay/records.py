"""What writers hand the store: model calls (``CallRecord``) and the statements that commit with them.

A ``Statement`` is built only by the store's repositories in ``replay/`` (feedback, agent runs, approvals,
bot messages, stored responses), never written by hand elsewhere: the schema has one owner.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from ulid import ULID

from replay.vocabulary import PROXY

Statement = tuple[str, tuple[Any, ...]]


def new_id() -> str:
    """Sortable identifiers: time order is id order."""
    return str(ULID())


def pack(value: Any) -> bytes | None:
    return None if value is None else zlib.compress(orjson.dumps(value), 1)


def unpack(value: bytes | None) -> Any:
    return None if value is None else orjson.loads(zlib.decompress(value))


@dataclass
class TrajectoryRef:
    """Where a call belongs: decided before the call runs, so its id can go out in the response headers."""

    id: str
    seq: int
    is_new: bool
    session_key: str | None = None
    parent_id: str | None = None
    group_id: str | None = None


@dataclass
class CallRecord:
    """One backend call and the trajectory it extends."""

    trajectory: TrajectoryRef
    request_messages: list[dict[str, Any]]
    request_prefix: list[str]  # stitch hashes of the request's message prefixes
    status: str
    source: str = PROXY
    tenant: str | None = None
    key_id: str | None = None
    requested_model: str | None = None
    base_model: str | None = None
    adapter: str | None = None
    backend: str | None = None
    tools: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] | None = None
    error: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[list[int]] | None = None
    completion_logprobs: list[list[float]] | None = None  # under the model itself
    completion_sampled_logprobs: list[list[float]] | None = None  # under the distribution sampled from
    # Tool calls of this step: call_id, name, raw_arguments, parsed, repaired, valid, validation_error,
    # status, and where they ran, result and duration_ms.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    # The exchange as it came through another API than chat completions: {"api", "request", "response"}.
    native: dict[str, Any] | None = None
    cost_usd: float | None = None  # at the gateway's price table; None when the model has no price


def split_choices(rec: CallRecord) -> list[CallRecord]:
    """A call that sampled ``n > 1`` choices becomes a group: one trajectory per choice.

    The first choice continues the request's trajectory; every other choice starts a sibling that
    shares its history and a ``group_id``, so a client that continues any choice extends its own
    trajectory, and RL sees the samples of one request as one group.
    """
    choices = (rec.response or {}).get("choices") or []
    if len(choices) < 2:
        return [rec]
    ref = rec.trajectory
    group = ref.group_id or new_id()
    out = []
    for i, choice in enumerate(choices):
        if i == 0:
            sibling_ref = replace(ref, group_id=group)
        else:
            sibling_ref = TrajectoryRef(id=new_id(), seq=0, is_new=True, session_key=ref.session_key,
                                        parent_id=ref.parent_id if ref.is_new else ref.id, group_id=group)
        usage = rec.response.get("usage") if i == 0 else None  # type: ignore[union-attr]
        out.append(replace(
            rec, trajectory=sibling_ref,
            response={**rec.response, "choices": [choice], **({"usage": usage} if usage else {})},  # type: ignore[dict-item]
            completion_tokens=(len(rec.completion_token_ids[i]) if rec.completion_token_ids
                               else rec.completion_tokens if i == 0 else 0),
            completion_token_ids=_pick(rec.completion_token_ids, i),
            completion_logprobs=_pick(rec.completion_logprobs, i),
            completion_sampled_logprobs=_pick(rec.completion_sampled_logprobs, i),
            cost_usd=rec.cost_usd if i == 0 else None,  # the request's cost, counted once, beside its usage
        ))
    return out


def _pick(per_choice: list[Any] | None, i: int) -> list[Any] | None:
    return [per_choice[i]] if per_choice is not None and i < len(per_choice) else None


@dataclass
class WriteOp:
    """What one caller commits at once: model calls, then plain statements (events, run state).

    Statements run after every call of their batch, so they may refer to the trajectories those calls create.
    """

    records: list[CallRecord] = field(default_factory=list)
    statements: list[Statement] = field(default_factory=list)
