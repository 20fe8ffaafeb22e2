"""Starting agent runs from profiles: the one place the API, the CLI and background runs share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from gateway.agent.limits import Limits
from gateway.agent.loop import AgentLoop, Event, Profile, RunState
from gateway.agent.recording import StoreRecorder
from gateway.auth import Principal
from gateway.backends.base import Backend
from gateway.config import ConfigError, ProfileSettings
from gateway.errors import model_not_found
from replay.store import TrajectoryStore, new_id
from tools.context import ToolContext
from tools.registry import ToolRegistry
from tools.toolbox import Toolbox

AGENT_PREFIX = "agent:"
LIMIT_KEYS = ("max_steps", "max_total_tokens", "deadline_seconds", "max_consecutive_tool_failures", "max_repeats")


def profile_from_settings(p: ProfileSettings) -> Profile:
    return Profile(name=p.name, model=p.model, system_prompt=p.system_prompt, tools=list(p.tools),
                   limits=Limits(**{k: getattr(p, k) for k in LIMIT_KEYS}),
                   context_budget_tokens=p.context_budget_tokens, keep_last_turns=p.keep_last_turns,
                   temperature=p.temperature, max_tokens=p.max_tokens)


class AgentService:
    def __init__(self, *, profiles: list[ProfileSettings], store: TrajectoryStore, registry: ToolRegistry,
                 tool_context: ToolContext, backend_for: Callable[[str], Backend]) -> None:
        self.profiles = {p.name: profile_from_settings(p) for p in profiles}
        self.store = store
        self.registry = registry
        self.tool_context = tool_context
        self.backend_for = backend_for
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
                limits: dict[str, Any] | None = None, on_event: Callable[[Event], None] | None = None,
                run_id: str | None = None) -> tuple[AgentLoop, StoreRecorder]:
        """A loop ready to run, and its recorder (whose ``start`` must be awaited first)."""
        profile = self.profile(profile_name)
        if limits:
            profile = Profile(**{**profile.__dict__, "limits": profile.limits.tightened(**limits)})
        backend = self.backend_for(profile.model)
        opening = [{"role": "system", "content": profile.system_prompt}] if profile.system_prompt else []
        state = RunState(run_id=run_id or new_id(), profile=profile.name, messages=opening + list(messages))
        recorder = StoreRecorder(self.store, profile=profile, backend=backend.name, tenant=principal.tenant,
                                 key_id=principal.key_id, capture=principal.capture)
        toolbox = Toolbox(self.registry, self.tool_context, profile.tools)
        # Count context with the backend's own tokenizer where it has one.
        loop = AgentLoop(profile=profile, backend=backend, toolbox=toolbox, recorder=recorder, state=state,
                         on_event=on_event, token_counter=getattr(backend, "count_tokens", None))
        return loop, recorder

    async def run(self, profile_name: str, messages: list[dict[str, Any]], principal: Principal, **kw: Any) -> RunState:
        loop, recorder = self.prepare(profile_name, messages, principal, **kw)
        await recorder.start(loop.state)
        return await loop.run()

    async def get(self, run_id: str, principal: Principal) -> dict[str, Any] | None:
        row = await self.store.agent_run(run_id)
        if row is None or (not principal.admin and row["tenant"] != principal.tenant):
            return None
        state = orjson.loads(row["state"]) if row["state"] else {}
        return {"id": run_id, "object": "agent.run", "profile": row["profile"], "status": row["status"],
                "termination_reason": row["termination_reason"], "steps": row["steps"],
                "created_at": row["created_at"], "updated_at": row["updated_at"],
                "output": state.get("final"), "messages": state.get("messages", []),
                "harness": orjson.loads(row["result"]) if row["result"] else None}

    async def interrupt_unfinished(self) -> int:
        """After a restart: runs that were mid-flight cannot continue on their own."""
        return await self.store.mark_runs(from_status="running", to_status="interrupted", at=time.time())

