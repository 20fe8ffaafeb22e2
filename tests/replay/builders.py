"""Hand-built trajectories written through the store's real write path, for the replay tests."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from replay import hashing
from replay.records import CallRecord, TrajectoryRef, WriteOp, new_id
from replay.store import TrajectoryStore

SYSTEM = {"role": "system", "content": "You are a careful agent."}
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]


def tool_call(call_id: str, expr: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": f'{{"expr": "{expr}"}}'}}


def assistant_calls(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def tool_result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def answer(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def response(message: dict[str, Any] | None) -> dict[str, Any]:
    choices = [] if message is None else [{
        "index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]
    return {"id": "chatcmpl-x", "object": "chat.completion", "model": "m", "choices": choices}


async def open_store(path: Path) -> TrajectoryStore:
    store = TrajectoryStore(str(path))
    await store.start()
    return store


async def write(store: TrajectoryStore, calls: list[tuple[list[dict[str, Any]], dict[str, Any] | None]], *,
                source: str = "agent", tenant: str | None = None, model: str | None = "base-m",
                adapter: str | None = None, tools: list[dict[str, Any]] | None = None,
                status: str | None = None, reason: str | None = None, reward: float | None = None,
                task: str | None = None, group: str | None = None, created_at: float | None = None,
                call_status: list[str] | None = None, token_ids: bool = True, logprobs: bool = False,
                tool_rows: list[list[dict[str, Any]]] | None = None, metadata: str | None = None) -> str:
    """One trajectory: ``calls`` are (request messages, reply) in order. Returns its id."""
    tid = new_id()
    when = time.time() if created_at is None else created_at
    records = []
    for seq, (request, reply) in enumerate(calls):
        st = call_status[seq] if call_status else "ok"
        records.append(CallRecord(
            trajectory=TrajectoryRef(id=tid, seq=seq, is_new=seq == 0, group_id=group),
            request_messages=request, request_prefix=hashing.prefix_hashes(request), status=st, source=source,
            tenant=tenant, requested_model=model, base_model=model, adapter=adapter, tools=tools,
            params={"temperature": 0.5, "purpose": "step"}, response=response(reply) if reply else None,
            error=None if st == "ok" else "upstream said no", prompt_tokens=10 * (seq + 1), completion_tokens=5,
            prompt_token_ids=list(range(seq, seq + 10)) if token_ids else None,
            completion_token_ids=[[100 + seq, 101 + seq]] if token_ids and reply else None,
            completion_logprobs=[[-0.5, -0.25]] if logprobs and token_ids and reply else None,
            completion_sampled_logprobs=[[-0.4, -0.2]] if logprobs and token_ids and reply else None,
            tool_calls=tool_rows[seq] if tool_rows else [], created_at=when))
    statements = [("UPDATE trajectories SET status = COALESCE(?, status), termination_reason = ?, final_reward = ?, "
                   "task_id = ?, metadata = ?, adapter = COALESCE(?, adapter) WHERE id = ?",
                   (status, reason, reward, task, metadata, adapter, tid))]
    await store.write(WriteOp(records=records, statements=statements))
    return tid


def tool_row(call_id: str, valid: bool) -> dict[str, Any]:
    return {"call_id": call_id, "name": "calculator", "raw_arguments": "{}", "parsed": True, "repaired": False,
            "valid": valid, "validation_error": None if valid else "missing expr", "status": "ok" if valid else "error",
            "result": "4", "duration_ms": 1.0}


async def agent_trajectory(store: TrajectoryStore, question: str = "What is 2+2?", *, final: str = "4",
                           result: str = "4", **kw: Any) -> str:
    """system, user → assistant(tool call) → tool → assistant(final): two model calls."""
    user = {"role": "user", "content": question}
    call = assistant_calls(tool_call("call_1", "2+2"))
    first = [SYSTEM, user]
    second = [SYSTEM, user, call, tool_result("call_1", result)]
    kw.setdefault("tools", TOOLS)
    return await write(store, [(first, call), (second, answer(final))], **kw)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def side_files(path: Path) -> list[str]:
    return sorted(f for f in os.listdir(path.parent) if f.startswith(path.name) and f != path.name)
