"""A scripted stand-in model: a backend that replays a fixed sequence of assistant messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from gateway.backends.base import BackendError, CallExtras, ChatRequest, ChatResult

Reply = dict[str, Any] | str | Callable[[dict[str, Any]], dict[str, Any] | str] | BackendError


def call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """An assistant message with one native tool call."""
    import json

    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id or f"call_{name}_{time.monotonic_ns()}", "type": "function",
         "function": {"name": name, "arguments": args}}]}


class ScriptedBackend:
    """Each chat() answers with the next scripted reply: a message, plain text, a function of the
    request body, or a BackendError to raise. Past the end of the script it answers "done"."""

    def __init__(self, script: list[Reply], *, name: str = "scripted", models: list[str] | None = None,
                 delay: float = 0.0, usage: tuple[int, int] = (10, 5)) -> None:
        self.script = list(script)
        self.name = name
        self.models = models or ["scripted-model"]
        self.delay = delay
        self.usage = usage
        self.requests: list[dict[str, Any]] = []

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def chat(self, request: ChatRequest) -> ChatResult:
        self.requests.append(request.body)
        if self.delay:
            await asyncio.sleep(self.delay)
        reply: Reply = self.script.pop(0) if self.script else "done"
        if callable(reply) and not isinstance(reply, BackendError):
            reply = reply(request.body)
        if isinstance(reply, BackendError):
            raise reply
        message = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        prompt, completion = self.usage
        return ChatResult(response={
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}},
            extras=CallExtras())

    async def stream(self, request: ChatRequest):  # pragma: no cover - the loop calls chat()
        raise NotImplementedError
