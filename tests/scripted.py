"""A scripted stand-in model: a backend that replays a fixed sequence of assistant messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from gateway.agent.context import approximate_tokens
from gateway.backends.base import BackendError, CallExtras, ChatRequest, ChatResult

Reply = dict[str, Any] | str | Callable[[dict[str, Any]], dict[str, Any] | str] | BackendError


# A config's backend entry for the scripted model; ``serve_scripted`` swaps the real backend for the script.
SCRIPTED_BACKEND = """
[[backends]]
name = "scripted"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
models = ["scripted-model"]
"""


def serve_scripted(app: Any, backend: ScriptedBackend) -> None:
    """Make a built gateway app think with ``backend`` (configured with ``SCRIPTED_BACKEND``)."""
    gateway = app.state.gateway
    gateway.backends = [backend]
    gateway.model_map.clear()  # in place: routing holds this very dict
    gateway.model_map["scripted-model"] = backend


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
                 delay: float = 0.0, usage: tuple[int, int] = (10, 5), counted: bool = False) -> None:
        self.script = list(script)
        self.name = name
        self.models = models or ["scripted-model"]
        self.delay = delay
        self.usage = usage
        self.requests: list[dict[str, Any]] = []
        if counted:
            # Like a backend with a tokenizer: it counts prompts as its usage reports them, and its completion
            # (``usage[1]`` tokens) stops at max_tokens.
            self.count_tokens = approximate_tokens
        self.counted = counted

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def chat(self, request: ChatRequest) -> ChatResult:
        return self._complete(request, await self._next(request))

    async def _next(self, request: ChatRequest) -> dict[str, Any]:
        self.requests.append(request.body)
        if self.delay:
            await asyncio.sleep(self.delay)
        reply: Reply = self.script.pop(0) if self.script else "done"
        if callable(reply) and not isinstance(reply, BackendError):
            reply = reply(request.body)
        if isinstance(reply, BackendError):
            raise reply
        return {"role": "assistant", "content": reply} if isinstance(reply, str) else reply

    def _complete(self, request: ChatRequest, message: dict[str, Any]) -> ChatResult:
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        prompt, completion = self.usage
        if self.counted:
            prompt = approximate_tokens(request.body["messages"], request.body.get("tools"))
            limit = request.body.get("max_tokens")
            if isinstance(limit, int):
                completion = min(completion, limit)
        return ChatResult(response={
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}},
            extras=CallExtras())

    async def stream(self, request: ChatRequest) -> ScriptedStream:
        return ScriptedStream(self._complete(request, await self._next(request)))


class ScriptedStream:
    """The scripted answer as chunks: words of text, then each tool call's name and argument fragments."""

    def __init__(self, result: ChatResult) -> None:
        self.result = result
        self.extras = result.extras

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        r = self.result.response
        base = {"id": r["id"], "object": "chat.completion.chunk", "created": r["created"], "model": r["model"]}
        choice = r["choices"][0]
        message = choice["message"]

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        if message.get("reasoning_content"):
            yield chunk({"reasoning_content": message["reasoning_content"]})
        for word in (message.get("content") or "").split(" "):
            if word:
                yield chunk({"content": word + " "})
        for i, c in enumerate(message.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                         "function": {"name": c["function"]["name"], "arguments": ""}}]})
            args = c["function"]["arguments"]
            for j in range(0, len(args), 4):
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j:j + 4]}}]})
        yield chunk({}, choice["finish_reason"])
        yield {**base, "choices": [], "usage": r["usage"]}

    async def aclose(self) -> None:
        pass
