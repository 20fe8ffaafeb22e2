"""Teachers: the right next assistant turn in any state a policy reached, and how the policy's own turn differs.

- ``SolverTeacher``: the suite's solver as a policy (``Suite.next_turn``): exact for the suite's own tasks.
- ``ServedTeacher``: any model a gateway serves (a larger upstream model, another adapter), asked through the
  gateway's chat completions route with the episode's tools; its turn becomes a label only when the agent loop would
  run it as written (``data.invalid_reply``): an invalid teacher turn is dropped and counted, never learnt.

``disagreement`` compares a policy's turn with the teacher's, by what the turn does rather than how it is written:
two calls agree when they are to the same tool and give the same result on a fault-free toolbox; two answers agree
when the policy's passes the verifier.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import httpx

from gateway.prompting import Message, message_text
from training.data import invalid_reply
from training.tasks import Suite, Task

# What a policy's turn did wrong, next to the teacher's (the kinds a correction round counts).
DISAGREEMENTS = ("answered_instead_of_calling", "called_instead_of_answering", "wrong_answer", "invalid_call",
                 "wrong_tool", "wrong_arguments", "calls_apart")


class Teacher(Protocol):
    name: str
    dropped: int  # turns that could not become labels (an invalid call, an unreachable teacher)

    async def next_turn(self, suite: Suite, task: Task, messages: list[Message],
                        tools: list[dict[str, Any]] | None) -> Message | None:
        """The right next assistant turn after ``messages`` (None: no usable turn, counted in ``dropped``)."""


class SolverTeacher:
    name = "solver"

    def __init__(self) -> None:
        self.dropped = 0

    async def next_turn(self, suite: Suite, task: Task, messages: list[Message],
                        tools: list[dict[str, Any]] | None) -> Message | None:
        return await suite.next_turn(task, messages)


class ServedTeacher:
    """A model the gateway at ``url`` serves, asked greedily with the state's messages and tools."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None, max_tokens: int = 256,
                 timeout_s: float = 120.0) -> None:
        self.name = model
        self.model = model
        self.max_tokens = max_tokens
        self.dropped = 0
        self.failures: dict[str, int] = {}  # why turns were dropped: invalid_call, http_<status>, unreachable
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def next_turn(self, suite: Suite, task: Task, messages: list[Message],
                        tools: list[dict[str, Any]] | None) -> Message | None:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": 0,
                                "max_tokens": self.max_tokens}
        if tools:
            body["tools"] = tools
        try:
            response = await self._client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError:
            return self._drop("unreachable")
        if response.status_code != 200:
            return self._drop(f"http_{response.status_code}")
        message = ((response.json().get("choices") or [{}])[0]).get("message") or {}
        turn: Message = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            turn["tool_calls"] = [{"id": c.get("id") or f"call_{i}", "type": "function",
                                   "function": {"name": c["function"]["name"],
                                                "arguments": c["function"].get("arguments") or "{}"}}
                                  for i, c in enumerate(message["tool_calls"], 1)]
        elif not turn["content"].strip():
            return self._drop("empty")
        if invalid_reply(turn, tools):
            return self._drop("invalid_call")
        return turn

    def _drop(self, why: str) -> None:
        self.dropped += 1
        self.failures[why] = self.failures.get(why, 0) + 1
        return None


async def disagreement(suite: Suite, task: Task, messages: list[Message], tools: list[dict[str, Any]] | None,
                       policy: Message, teacher: Message) -> str | None:
    """How the policy's turn differs from the teacher's (one of ``DISAGREEMENTS``), or None when it does the same."""
    wanted, made = teacher.get("tool_calls") or [], policy.get("tool_calls") or []
    if not wanted:
        if made:
            return "called_instead_of_answering"
        final = message_text(policy.get("content"))
        return None if suite.verify(task, final, [*messages, policy]) else "wrong_answer"
    if not made:
        return "answered_instead_of_calling"
    if invalid_reply(policy, tools):
        return "invalid_call"
    mine, theirs = made[0]["function"], wanted[0]["function"]
    if mine["name"] != theirs["name"]:
        return "wrong_tool"
    box = suite.clean_toolbox(task)
    got = await box.execute(mine["name"], json.loads(mine.get("arguments") or "{}"))
    expected = await box.execute(theirs["name"], json.loads(theirs.get("arguments") or "{}"))
    if got.status != "ok" or got.output.strip() != expected.output.strip():
        return "wrong_arguments"
    # The right first call, but not the others the teacher makes with it in one turn (independent calls).
    return "calls_apart" if len(made) < len(wanted) else None
