"""Starting agent runs from profiles, and continuing them from the store: the one place the API, the CLI,
background runs, approvals and the chat bot share."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson
import structlog

from gateway.agent.limits import Limits
from gateway.agent.loop import AgentLoop, Profile, RunState, StepEvent
from gateway.agent.recording import StoreRecorder
from gateway.auth import Principal
from gateway.backends.base import Backend
from gateway.config import ConfigError, ProfileSettings
from gateway.errors import APIError, model_not_found
from gateway.keyed_lock import KeyedLock
from gateway.quotas.admission import Meter
from gateway.quotas.settings import Limits as KeyLimits
from replay import approvals, keys, runs
from replay.records import new_id
from replay.store import TrajectoryStore
from replay.vocabulary import AGENT
from tools.context import ToolContext
from tools.registry import ToolRegistry
from tools.toolbox import Toolbox

log = structlog.get_logger()

AGENT_PREFIX = "agent:"
LIMIT_KEYS = ("max_steps", "max_total_tokens", "deadline_seconds", "max_consecutive_tool_failures", "max_repeats")


def profile_from_settings(p: ProfileSettings) -> Profile:
    return Profile(name=p.name, model=p.model, system_prompt=p.system_prompt, tools=list(p.tools),
                   limits=Limits(**{k: getattr(p, k) for k in LIMIT_KEYS}),
                   context_budget_tokens=p.context_budget_tokens, keep_last_turns=p.keep_last_turns,
                   temperature=p.temperature, max_tokens=p.max_tokens, constrain_tool_calls=p.constrain_tool_calls)


class AgentService:
    """Runs carry leases (``replay/runs.py``): a run is carried on only by the process holding its lease, taken when
    the run starts or resumes, renewed by ``renew_leases`` while it goes on, released when it pauses or ends.

    The same rule holds on SQLite and PostgreSQL. Nothing is marked ``interrupted`` at start any more: on a shared
    store the runs left ``running`` may be other live replicas', and a lease tells them apart from a dead process's,
    which ``sweep`` takes over once its lease expires. On SQLite (one gateway process) that means a run a crash cut
    short goes on up to ``run_lease_seconds`` after the restart, instead of staying ``interrupted``; the rule needs
    no knowledge of who else uses the store (a command such as ``harness run`` opens it beside the gateway).
    """

    def __init__(self, *, profiles: list[ProfileSettings], store: TrajectoryStore, registry: ToolRegistry,
                 tool_context: ToolContext, backend_for: Callable[[str], Backend],
                 spawn: Callable[[Coroutine[Any, Any, Any]], None] | None = None,
                 on_usage: Callable[[str, int, int], None] | None = None,
                 meter_for: Callable[[str | None, KeyLimits | None, str | None, str], Meter | None] | None = None
                 ) -> None:
        self.profiles = {p.name: profile_from_settings(p) for p in profiles}
        self.store = store
        self.registry = registry
        self.tool_context = tool_context
        self.backend_for = backend_for
        self.spawn = spawn
        self.on_usage = on_usage  # (model, prompt tokens, completion tokens) of every model call a run makes
        # (key id, the key's own limits, tenant, profile model) -> the limits a run's model calls count against
        self.meter_for = meter_for
        self.approval_expiry_seconds = tool_context.settings.approval_expiry_seconds
        # This process among all that share the store: a host may run several, and a pid may come back.
        self.lease = runs.Lease(owner=f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}",
                                seconds=tool_context.settings.run_lease_seconds)
        # Within this process, a run goes on in one place at a time (its first start, a resume after approval, a
        # conversation's turn); across processes the lease sees to that.
        self.runs = KeyedLock()
        # Called with the state of every run that ``resume`` carried on to its end (or its next pause).
        self.on_finish: list[Callable[[RunState], Awaitable[None]]] = []
        for profile in self.profiles.values():
            missing = [t for t in profile.tools if t not in registry]
            if missing:
                raise ConfigError(f"profile {profile.name!r} names unknown tools: {', '.join(missing)} "
                                  f"(known: {', '.join(registry.names())})")

    def profile(self, name: str) -> Profile:
        found = self.profiles.get(name)
        if found is None:
            raise model_not_found(f"No agent profile '{name}'. "
                                  f"Configured: {', '.join(sorted(self.profiles)) or 'none'}.")
        return found

    def prepare(self, profile_name: str, messages: list[dict[str, Any]], principal: Principal, *,
                limits: dict[str, Any] | None = None, on_event: Callable[[StepEvent], None] | None = None,
                run_id: str | None = None, hold_for_approval: bool = False, source: str = AGENT,
                metadata: dict[str, Any] | None = None) -> tuple[AgentLoop, StoreRecorder]:
        """A loop ready to run, and its recorder (whose ``start`` must be awaited first). Only a run nobody waits
        on (``hold_for_approval``) may pause for a person; others are refused such calls."""
        profile = self.profile(profile_name)
        if limits:
            profile = Profile(**{**profile.__dict__, "limits": profile.limits.tightened(**limits)})
        opening = [{"role": "system", "content": profile.system_prompt}] if profile.system_prompt else []
        state = RunState(run_id=run_id or new_id(), profile=profile.name, messages=opening + list(messages))
        return self._loop(profile, state, tenant=principal.tenant, key_id=principal.key_id, source=source,
                          capture=principal.capture, metadata=metadata, on_event=on_event,
                          hold_for_approval=hold_for_approval, key_limits=principal.limits)

    def _loop(self, profile: Profile, state: RunState, *, tenant: str | None, key_id: str | None, source: str,
              capture: bool = True, metadata: dict[str, Any] | None = None,
              on_event: Callable[[StepEvent], None] | None = None,
              hold_for_approval: bool = False, key_limits: KeyLimits | None = None) -> tuple[AgentLoop, StoreRecorder]:
        backend = self.backend_for(profile.model)
        meter = self.meter_for(key_id, key_limits, tenant, profile.model) if self.meter_for else None
        recorder = StoreRecorder(self.store, profile=profile, backend=backend.name, tenant=tenant, key_id=key_id,
                                 source=source, capture=capture, metadata=metadata,
                                 approval_expiry_seconds=self.approval_expiry_seconds, lease=self.lease,
                                 on_usage=self.on_usage)
        toolbox = Toolbox(self.registry, self.tool_context, profile.tools)
        # Count context with the backend's own tokenizer where it has one.
        loop = AgentLoop(profile=profile, backend=backend, toolbox=toolbox, recorder=recorder, state=state,
                         on_event=on_event, token_counter=getattr(backend, "count_tokens", None),
                         hold_for_approval=hold_for_approval, tenant=tenant, meter=meter)
        return loop, recorder

    async def load(self, run_id: str) -> tuple[AgentLoop, StoreRecorder] | None:
        """The run the store holds, ready to go on in the background (it may pause for approval again); None when
        there is none, or its profile is no longer configured."""
        row = await runs.get(self.store, run_id)
        if row is None or not row["state"]:
            return None
        profile = self.profiles.get(row["profile"])
        if profile is None:
            log.warning("agent.profile_gone", trajectory_id=run_id, profile=row["profile"])
            return None
        state = RunState.from_dict(orjson.loads(row["state"]))
        own = await keys.own_limits(self.store, row["key_id"]) if row["key_id"] else None
        loop, recorder = self._loop(profile, state, tenant=row["tenant"], key_id=row["key_id"],
                                    source=row["source"], hold_for_approval=True,
                                    key_limits=KeyLimits.model_validate(own) if own else None)
        loop.cancelled_as = ("interrupted", None)
        return loop, recorder

    @contextlib.asynccontextmanager
    async def leased(self, run_id: str) -> AsyncIterator[bool]:
        """The run for the caller alone: within this process (its lock), and among all that share the store (its
        lease, released on leaving); whether the lease was had. Without it, another process carries the run on."""
        async with self.runs.hold(run_id):
            if not await runs.acquire(self.store, run_id, self.lease, now=time.time()):
                yield False
                return
            try:
                yield True
            finally:
                await runs.release(self.store, run_id, self.lease.owner)

    async def resume(self, run_id: str) -> RunState | None:
        """Carry on a run from the store: one paused for approval whose held calls are all decided, or one a stop
        or a dead process cut off. None when there is nothing to do (yet), or another process holds its lease.

        The state is read after the lease is taken, so a run another process just finished or paused again is
        seen as it left it, and not carried on twice."""
        async with self.leased(run_id) as mine:
            state = await self._carry_on(run_id) if mine else None
        if state is None:
            return None
        log.info("agent.resumed", trajectory_id=run_id, status=state.status)
        for listener in self.on_finish:
            await listener(state)
        return state

    async def _carry_on(self, run_id: str) -> RunState | None:
        """``resume`` once the lease is held."""
        loaded = await self.load(run_id)
        if loaded is None:  # its profile is gone
            await runs.interrupt(self.store, run_id, at=time.time())
            return None
        loop = loaded[0]
        state = loop.state
        if state.status == "pending_approval":
            decided = await approvals.decisions(self.store, run_id)
            if any(held["id"] not in decided for held in state.pending):
                return None
            return await loop.run(decided)
        # "running": saved mid-run by a process that died (a stop saves "interrupted"); the lease, free or
        # expired, says nobody else carries it on. It goes on from its last saved step.
        if state.status in ("interrupted", "running"):
            state.status = "running"
            return await loop.run()
        return None

    async def decide(self, approval_id: str, *, approve: bool, reason: str | None, by: str) -> dict[str, Any]:
        """Approve or deny a held call; the run goes on in the background once all its held calls are decided."""
        row, changed = await approvals.decide(self.store, approval_id, approve=approve, reason=reason, by=by,
                                              now=time.time())
        if row is None:
            raise APIError(404, f"No approval '{approval_id}'.", code="not_found")
        if not changed:
            raise APIError(409, approvals.refusal(row), code="already_decided")
        self._resume_later(row["trajectory_id"])
        return row

    async def sweep(self) -> None:
        """Expire overdue approvals; resume runs whose calls were all decided elsewhere (the command line, another
        gateway process) or while this one was down; take over runs left ``running`` by a process that died (their
        lease expired). Every other process sweeps too: whichever takes a run's lease first carries it on."""
        now = time.time()
        expired = await approvals.expire(self.store, now)
        if expired:
            log.info("approvals.expired", count=expired)
        for run_id in await approvals.settled_runs(self.store):
            if not self.runs.busy(run_id):
                self._resume_later(run_id)
        for row in await runs.orphaned(self.store, owner=self.lease.owner, now=now):
            if not self.runs.busy(row["id"]):
                # Every live process may see it; the one whose resume takes the lease logs agent.resumed.
                log.warning("agent.run_orphaned", trajectory_id=row["id"], last_owner=row["lease_owner"])
                self._resume_later(row["id"])

    async def renew_leases(self) -> None:
        """Keep the leases of the runs this process carries on from expiring (every third of their time)."""
        await runs.renew(self.store, self.lease, now=time.time())

    def _resume_later(self, run_id: str) -> None:
        assert self.spawn is not None, "resuming in the background needs spawn"
        self.spawn(self.resume(run_id))

    async def run(self, profile_name: str, messages: list[dict[str, Any]], principal: Principal, **kw: Any) -> RunState:
        loop, recorder = self.prepare(profile_name, messages, principal, **kw)
        await recorder.start(loop.state)
        return await loop.run()

    async def get(self, run_id: str, principal: Principal) -> dict[str, Any] | None:
        row = await runs.get(self.store, run_id)
        if row is None or (not principal.admin and row["tenant"] != principal.tenant):
            return None
        state = orjson.loads(row["state"]) if row["state"] else {}
        held = await approvals.list_approvals(self.store, trajectory_id=run_id) if state.get("pending") else []
        return {"id": run_id, "object": "agent.run", "profile": row["profile"], "status": row["status"],
                "termination_reason": row["termination_reason"], "steps": row["steps"],
                "created_at": row["created_at"], "updated_at": row["updated_at"],
                "output": state.get("final"), "messages": state.get("messages", []), "approvals": held,
                "harness": orjson.loads(row["result"]) if row["result"] else None}
