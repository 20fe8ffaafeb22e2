"""Reading trajectories into the read model (``replay.model``): one trajectory whole, or a listing; and the
model_calls columns a ``StoredCall`` is read from, for every reader of calls."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from replay.database import Database
from replay.filters import Filters
from replay.model import CHAT, AgentRun, Feedback, ModelCall, RunEvent, StoredCall, ToolCall, Trajectory, content_text

_SUMMARY_FIELDS = ("id", "source", "status", "created_at", "updated_at", "tenant", "key_id", "session_key",
                   "requested_model", "base_model", "adapter", "adapter_version", "task_id", "group_id", "parent_id",
                   "termination_reason", "message_count", "n_calls", "prompt_tokens", "completion_tokens",
                   "latency_ms", "final_reward")


def _first(rows: Iterable[Any]) -> Any | None:
    return next(iter(rows), None)


def _summary(row: Any) -> dict[str, Any]:
    fields = {name: row[name] for name in _SUMMARY_FIELDS}
    fields["metadata"] = orjson.loads(row["metadata"]) if row["metadata"] else None
    return fields


async def listing(db: Database, *, tenant: str | None, all_tenants: bool, limit: int,
                  before: str | None, matching: tuple[str, Any] | None = None,
                  filters: Filters | None = None) -> list[Trajectory]:
    """Trajectories newest first, without their calls; with ``matching`` (a query of trajectory ids and its
    argument), only those it names; with ``filters``, only those they select."""
    where: list[str] = []
    args: list[Any] = []
    if filters is not None:
        clause, values = filters.where("t")
        where.append(clause)
        args.extend(values)
    if matching is not None:
        where.append(f"id IN ({matching[0]})")
        args.append(matching[1])
    if not all_tenants:
        where.append("tenant IS ?")
        args.append(tenant)
    if before:
        where.append("id < ?")
        args.append(before)
    sql = "SELECT * FROM trajectories t" + (" WHERE " + " AND ".join(where) if where else "")
    return [Trajectory(**_summary(r)) for r in await db.fetchall(sql + " ORDER BY id DESC LIMIT ?",
                                                                         (*args, limit))]


async def trajectory(db: Database, trajectory_id: str, *, tenant: str | None,
                     all_tenants: bool) -> Trajectory | None:
    """A trajectory whole: its calls (message bodies in place), tool calls, events, feedback and run."""
    row = _first(await db.fetchall("SELECT * FROM trajectories WHERE id = ?", (trajectory_id,)))
    if row is None or (not all_tenants and row["tenant"] != tenant):
        return None
    calls = await _calls(db, trajectory_id)
    # The API its calls came through (one per trajectory: a session's calls come through one API).
    api = next((c.native["api"] for c in calls if c.native), CHAT)
    return Trajectory(**_summary(row), format=api, calls=calls,
                      tool_calls=await _tool_calls(db, trajectory_id, calls),
                      events=await _events(db, trajectory_id), feedback=await _feedback(db, trajectory_id),
                      run=await _run(db, trajectory_id))


# The model_calls columns, in the order ``stored_call`` reads them. Log-probabilities come last and are the largest:
# a reader that never looks at them (the export) selects ``CALL_COLUMNS_WITHOUT_LOGPROBS`` and leaves them on disk.
CALL_COLUMNS_WITHOUT_LOGPROBS = (
    "trajectory_id, id, seq, created_at, status, request_messages, tools_hash, response_messages, params, response, "
    "backend, model, adapter, stream, error, prompt_tokens, completion_tokens, latency_ms, ttft_ms, prompt_token_ids, "
    "completion_token_ids")
CALL_COLUMNS = CALL_COLUMNS_WITHOUT_LOGPROBS + ", completion_logprobs, completion_sampled_logprobs"


def stored_call(row: Sequence[Any]) -> StoredCall:
    """A ``CALL_COLUMNS`` (or ``CALL_COLUMNS_WITHOUT_LOGPROBS``) row as a ``StoredCall``."""
    (tid, cid, seq, created, status, request, tools, replies, params, response, backend, model, adapter, stream,
     error, prompt_tokens, completion_tokens, latency_ms, ttft_ms, *packed) = row
    return StoredCall(tid, cid, seq, created, status, orjson.loads(request), tools,
                      orjson.loads(replies) if replies else [], params, response, *packed, backend=backend,
                      model=model, adapter=adapter, stream=bool(stream), error=error, prompt_tokens=prompt_tokens,
                      completion_tokens=completion_tokens, latency_ms=latency_ms, ttft_ms=ttft_ms)


async def _calls(db: Database, trajectory_id: str) -> list[ModelCall]:
    stored = [stored_call(r) for r in await db.fetchall(
        f"SELECT {CALL_COLUMNS} FROM model_calls WHERE trajectory_id = ? ORDER BY seq, created_at", (trajectory_id,))]
    # The exchanges kept as they came through another API: read here alone (the export needs the chat messages only).
    native = {cid: (api, orjson.loads(keys)) for cid, api, keys in await db.fetchall(
        "SELECT id, native_api, native_bodies FROM model_calls WHERE trajectory_id = ? AND native_api IS NOT NULL",
        (trajectory_id,))}
    keys = {k for c in stored for k in c.body_keys} | {k for _, kept in native.values() for k in kept}
    bodies = await blobs(db, keys)
    calls = [c.to_model_call(bodies) for c in stored]
    for call in calls:
        if call.id in native:
            api, kept = native[call.id]
            call.native = {"api": api, "request": bodies.get(kept[0]),
                           "response": bodies.get(kept[1]) if len(kept) > 1 else None}
    return calls


async def blobs(db: Database, keys: Iterable[str]) -> dict[str, Any]:
    keys = list(keys)
    out: dict[str, Any] = {}
    for i in range(0, len(keys), 500):
        chunk = keys[i:i + 500]
        marks = ",".join("?" * len(chunk))
        for h, body in await db.fetchall(f"SELECT hash, body FROM blobs WHERE hash IN ({marks})", chunk):
            out[h] = orjson.loads(body)
    return out


async def _tool_calls(db: Database, trajectory_id: str, calls: list[ModelCall]) -> list[ToolCall]:
    # A call returned to the client (proxy mode) has its result in the client's next request.
    client_results: dict[str, str] = {}
    for c in calls:
        for m in c.messages:
            if isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id"):
                client_results.setdefault(m["tool_call_id"], content_text(m.get("content")) or "")
    rows = await db.fetchall("SELECT * FROM tool_calls WHERE trajectory_id = ? ORDER BY step, created_at, "
                                     "rowid", (trajectory_id,))
    return [ToolCall(
        step=r["step"], call_id=r["call_id"], name=r["name"], arguments=r["raw_arguments"] or "",
        valid=bool(r["valid"]), status=r["status"],
        result=r["result"] if r["result"] is not None or r["status"] != "returned"
        else client_results.get(r["call_id"] or ""),
        parsed=bool(r["parsed"]), repaired=bool(r["repaired"]), validation_error=r["validation_error"],
        duration_ms=r["duration_ms"], created_at=r["created_at"]) for r in rows]


async def _events(db: Database, trajectory_id: str) -> list[RunEvent]:
    return [RunEvent(step=r[0], state=r[1], data=orjson.loads(r[2]) if r[2] else None, created_at=r[3])
            for r in await db.fetchall("SELECT step, state, data, created_at FROM events "
                                               "WHERE trajectory_id = ? ORDER BY id", (trajectory_id,))]


async def _feedback(db: Database, trajectory_id: str) -> list[Feedback]:
    return [Feedback(source=r["source"], name=r["name"], value=r["value"], label=r["label"], comment=r["comment"],
                     model_call_seq=r["model_call_seq"], created_at=r["created_at"])
            for r in await db.fetchall("SELECT * FROM feedback WHERE trajectory_id = ? "
                                               "ORDER BY created_at, id", (trajectory_id,))]


async def _run(db: Database, trajectory_id: str) -> AgentRun | None:
    r = _first(await db.fetchall("SELECT * FROM agent_runs WHERE id = ?", (trajectory_id,)))
    if r is None:
        return None
    return AgentRun(profile=r["profile"], status=r["status"], termination_reason=r["termination_reason"],
                    steps=r["steps"], state=orjson.loads(r["state"]) if r["state"] else {},
                    result=orjson.loads(r["result"]) if r["result"] else None, created_at=r["created_at"],
                    updated_at=r["updated_at"])


async def progress(db: Database, trajectory_id: str) -> tuple[Any, ...] | None:
    """What changes as a run goes on (status, calls, events, tool calls, last update), or None when there is no such
    trajectory: cheap enough to ask twice a second while a page follows the run."""
    row = _first(await db.fetchall(
        "SELECT status, n_calls, updated_at, (SELECT COUNT(*) FROM events WHERE trajectory_id = t.id), "
        "(SELECT COUNT(*) FROM tool_calls WHERE trajectory_id = t.id) FROM trajectories t WHERE id = ?",
        (trajectory_id,)))
    return None if row is None else tuple(row)
