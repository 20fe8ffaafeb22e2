"""Persists agent runs in the trajectory store: each step's model call, tool calls, events and run state
commit together, so the store always holds a state the run can be resumed from."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.agent.loop import Profile, RunState, StepRecord
from replay import approvals, hashing, runs
from replay.records import CallRecord, Statement, TrajectoryRef, WriteOp
from replay.store import TrajectoryStore
from replay.vocabulary import AGENT
from tools.settings import ToolsSettings


class StoreRecorder:
    def __init__(self, store: TrajectoryStore, *, profile: Profile, backend: str, tenant: str | None = None,
                 key_id: str | None = None, source: str = AGENT, capture: bool = True,
                 approval_expiry_seconds: float | None = None, metadata: dict[str, Any] | None = None,
                 lease: runs.Lease | None = None, on_usage: Callable[[str, int, int], None] | None = None) -> None:
        self.store = store
        self.profile = profile
        self.backend = backend
        self.tenant = tenant
        self.key_id = key_id
        self.source = source
        self.capture = capture
        # None: [tools] approval_expiry_seconds' own default, the only one
        self.approval_expiry_seconds = (ToolsSettings.default_of("approval_expiry_seconds")
                                        if approval_expiry_seconds is None else approval_expiry_seconds)
        self.metadata = metadata
        self.lease = lease  # the process's, taken with the run's first commit and kept with each step
        self.on_usage = on_usage

    async def start(self, state: RunState) -> None:
        if not self.capture:
            return
        await self.store.write(WriteOp(statements=runs.start_statements(runs.RunStart(
            run_id=state.run_id, profile=self.profile.name, status=state.status, state=state.to_dict(),
            source=self.source, tenant=self.tenant, key_id=self.key_id, requested_model=f"agent:{self.profile.name}",
            base_model=self.profile.model, message_count=len(state.messages), metadata=self.metadata,
            at=time.time(), lease=self.lease))))

    async def step(self, state: RunState, record: StepRecord, also: list[Statement] | None = None) -> None:
        """Persist one step with the run's state; ``also`` are more statements for the same commit."""
        if self.on_usage is not None and record.result is not None:
            usage = record.result.response.get("usage") or {}
            self.on_usage(self.profile.model, int(usage.get("prompt_tokens") or 0),
                          int(usage.get("completion_tokens") or 0))
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
                # A pool's member (or a gateway's backend) that answered, where the backend named one.
                backend=(record.result.backend if record.result else None) or self.backend,
                tools=record.request.get("tools"),
                params={**{k: v for k, v in record.request.items() if k not in ("messages", "tools", "model")},
                        "purpose": record.purpose, "step": record.step},
                response=response, error=record.error, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0), latency_ms=record.latency_ms,
                prompt_token_ids=getattr(extras, "prompt_token_ids", None),
                completion_token_ids=getattr(extras, "completion_token_ids", None),
                completion_logprobs=getattr(extras, "completion_logprobs", None),
                completion_sampled_logprobs=getattr(extras, "completion_sampled_logprobs", None),
                tool_calls=[{"call_id": c.id, "name": c.name, "raw_arguments": c.raw_arguments, "parsed": c.parsed,
                             "repaired": c.repaired, "valid": c.valid, "validation_error": c.error,
                             "status": o.status, "result": o.output, "duration_ms": o.duration_ms}
                            for c, o in record.calls]))
            state.model_calls += 1
        statements: list[Statement] = list(also or [])
        statements += [approvals.hold_statement(
            state.run_id, approval_id=a["id"], step=record.step, call_id=a["call_id"], tool=a["name"],
            arguments=a["arguments"], at=now, expires_at=now + self.approval_expiry_seconds) for a in record.approvals]
        statements += [runs.decided_call_statement(state.run_id, call_id, status=outcome.status, result=outcome.output,
                                                   duration_ms=outcome.duration_ms)
                       for call_id, outcome in record.decided]
        statements += [runs.event_statement(state.run_id, step=e.step, state=e.state, data=e.data, at=e.created_at)
                       for e in record.events]
        statements += runs.progress_statements(runs.RunProgress(
            run_id=state.run_id, status=state.status,
            termination_reason=state.termination_reason, steps=state.budget.steps, state=state.to_dict(),
            result=state.harness(), at=now, lease=self.lease))
        await self.store.write(WriteOp(records=records, statements=statements))
