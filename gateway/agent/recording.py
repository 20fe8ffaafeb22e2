"""Persists agent runs in the trajectory store: each step's model call, tool calls, events and run state
commit together, so the store always holds a state the run can be resumed from."""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.agent.loop import Profile, RunState, StepRecord
from replay import hashing
from replay.store import CallRecord, TrajectoryRef, TrajectoryStore, WriteOp

_TRAJECTORY_STATUS = {"running": "running", "completed": "completed", "terminated": "terminated",
                      "error": "error", "interrupted": "interrupted", "pending_approval": "pending_approval"}


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


class StoreRecorder:
    def __init__(self, store: TrajectoryStore, *, profile: Profile, backend: str, tenant: str | None = None,
                 key_id: str | None = None, source: str = "agent", capture: bool = True,
                 approval_expiry_seconds: float = 86_400.0, metadata: dict[str, Any] | None = None) -> None:
        self.store = store
        self.profile = profile
        self.backend = backend
        self.tenant = tenant
        self.key_id = key_id
        self.source = source
        self.capture = capture
        self.approval_expiry_seconds = approval_expiry_seconds
        self.metadata = metadata

    async def start(self, state: RunState) -> None:
        if not self.capture:
            return
        now = time.time()
        await self.store.write(WriteOp(statements=[
            ("""INSERT OR IGNORE INTO trajectories(id, source, tenant, key_id, requested_model, base_model, status,
                    message_count, metadata, created_at, updated_at)
                VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?)""",
             (state.run_id, self.source, self.tenant, self.key_id, f"agent:{self.profile.name}", self.profile.model,
              len(state.messages), _json(self.metadata) if self.metadata else None, now, now)),
            ("""INSERT OR IGNORE INTO agent_runs(id, profile, status, steps, state, created_at, updated_at)
                VALUES (?, ?, ?, 0, ?, ?, ?)""",
             (state.run_id, self.profile.name, state.status, _json(state.to_dict()), now, now)),
        ]))

    async def step(self, state: RunState, record: StepRecord,
                   also: list[tuple[str, tuple[Any, ...]]] | None = None) -> None:
        """Persist one step with the run's state; ``also`` are more statements for the same commit."""
        if not self.capture:
            return
        now = time.time()
        records = []
        if record.request is not None:
            messages = record.request["messages"]
            response = record.result.response if record.result else None
            usage = (response or {}).get("usage") or {}
            extras = record.result.extras if record.result else None
            records.append(CallRecord(
                trajectory=TrajectoryRef(id=state.run_id, seq=state.model_calls, is_new=False),
                request_messages=messages, request_prefix=hashing.prefix_hashes(messages),
                status="ok" if record.error is None else "error", source=self.source, tenant=self.tenant,
                key_id=self.key_id, requested_model=f"agent:{self.profile.name}", base_model=self.profile.model,
                backend=self.backend, tools=record.request.get("tools"),
                params={**{k: v for k, v in record.request.items() if k not in ("messages", "tools", "model")},
                        "purpose": record.purpose, "step": record.step},
                response=response, error=record.error, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0), latency_ms=record.latency_ms,
                prompt_token_ids=getattr(extras, "prompt_token_ids", None),
                completion_token_ids=getattr(extras, "completion_token_ids", None),
                completion_logprobs=getattr(extras, "completion_logprobs", None),
                tool_calls=[{"call_id": c.id, "name": c.name, "raw_arguments": c.raw_arguments, "parsed": c.parsed,
                             "repaired": c.repaired, "valid": c.valid, "validation_error": c.error,
                             "status": o.status, "result": o.output, "duration_ms": o.duration_ms}
                            for c, o in record.calls]))
            state.model_calls += 1
        statements: list[tuple[str, tuple[Any, ...]]] = list(also or [])
        for a in record.approvals:
            statements.append(("""INSERT INTO approvals(id, trajectory_id, step, call_id, tool, arguments, status,
                                      created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)""",
                               (a["id"], state.run_id, record.step, a["call_id"], a["name"], _json(a["arguments"]),
                                now, now + self.approval_expiry_seconds)))
        for call_id, outcome in record.decided:
            statements.append(("UPDATE tool_calls SET status = ?, result = ?, duration_ms = ? WHERE trajectory_id = ? "
                               "AND call_id = ? AND status = 'pending_approval'",
                               (outcome.status, outcome.output, outcome.duration_ms, state.run_id, call_id)))
        for event in record.events:
            statements.append(("INSERT INTO events(trajectory_id, step, state, data, created_at) "
                               "VALUES (?, ?, ?, ?, ?)",
                               (state.run_id, event.step, event.state, _json(event.data), event.created_at)))
        statements.append((
            """UPDATE agent_runs SET status = ?, termination_reason = ?, steps = ?, state = ?, result = ?,
                   updated_at = ? WHERE id = ?""",
            (state.status, state.termination_reason, state.budget.steps, _json(state.to_dict()),
             _json(state.harness()), now, state.run_id)))
        statements.append((
            "UPDATE trajectories SET status = ?, termination_reason = ?, updated_at = ? WHERE id = ?",
            (_TRAJECTORY_STATUS[state.status], state.termination_reason, now, state.run_id)))
        await self.store.write(WriteOp(records=records, statements=statements))
