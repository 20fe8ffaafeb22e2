"""A stand-in OpenAI-compatible upstream for tests: a small ASGI app on a loopback port.

Its behaviour is chosen by the last user message, so a test steers it through the real gateway:
``status:503`` answers that status, ``slow:2`` waits two seconds, ``garbage`` answers non-JSON,
``flaky`` fails the first attempt of each distinct request, ``stall`` streams one chunk then hangs,
``tool`` answers with a tool call, ``deep:N`` adds a field nested N levels to its answer, ``overflow`` counts more
tokens than an SQLite integer holds; anything else is echoed back as ``echo: <text>``.
Every request it receives is kept in ``calls``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.markers import require_integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content or ""
    return ""


class StandIn:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.seen_flaky: set[str] = set()
        self.disconnects = 0
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.calls.append(body)
        text = _last_user_text(body)
        command, _, arg = text.partition(":")
        if command == "status":
            return Response(orjson.dumps({"error": {"message": f"stand-in failure {arg}", "type": "server_error",
                                                    "param": None, "code": None}}),
                            status_code=int(arg), media_type="application/json")
        if command == "slow":
            await asyncio.sleep(float(arg))
        if command == "garbage":
            return Response(b"<html>not json</html>", media_type="text/html")
        if command == "flaky" and text not in self.seen_flaky:
            self.seen_flaky.add(text)
            return Response(b'{"error": {"message": "try again"}}', status_code=503, media_type="application/json")
        message: dict[str, Any] = {"role": "assistant", "content": f"echo: {text}"}
        if command == "big":  # a reply of about int(arg) characters, in words of a thousand
            message["content"] = " ".join("x" * 999 for _ in range(int(arg) // 1000))
        finish = "stop"
        if command == "tool":
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
            finish = "tool_calls"
        usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
        if command == "overflow":
            usage["prompt_tokens"] = usage["total_tokens"] = 2**64 - 1
        base: dict[str, Any] = {"id": "chatcmpl-standin", "created": int(time.time()), "model": body.get("model")}
        if command == "deep":
            nested: list[Any] = []
            for _ in range(int(arg)):
                nested = [nested]
            base["system_fingerprint_detail"] = nested
        if not body.get("stream"):
            answer = {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}], "usage": usage}
            # orjson writes at most 254 levels; the standard library goes as deep as its recursion limit.
            return Response(json.dumps(answer).encode() if command == "deep" else orjson.dumps(answer),
                            media_type="application/json")
        return StreamingResponse(self._stream(base, message, finish, usage, body, command),
                                 media_type="text/event-stream")

    async def _stream(self, base: dict[str, Any], message: dict[str, Any], finish: str, usage: dict[str, Any],
                      body: dict[str, Any], command: str):
        chunk = {**base, "object": "chat.completion.chunk"}

        def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            data = {**chunk, "choices": choices, **extra}
            return b"data: " + (json.dumps(data).encode() if command == "deep" else orjson.dumps(data)) + b"\n\n"

        try:
            yield frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            if command == "stall":
                await asyncio.sleep(3600)
            if message.get("tool_calls"):
                call = message["tool_calls"][0]
                yield frame([{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": ""}}]},
                              "finish_reason": None}])
                args = call["function"]["arguments"]
                for i in range(0, len(args), 5):
                    yield frame([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
                        "arguments": args[i:i + 5]}}]}, "finish_reason": None}])
            else:
                for word in message["content"].split(" "):
                    yield frame([{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}])
                    await asyncio.sleep(0)
            yield frame([{"index": 0, "delta": {}, "finish_reason": finish}])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield frame([], usage=usage)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise


class ServerThread:
    """Runs an ASGI app with uvicorn on a loopback port in a background thread."""

    def __init__(self, app: Any, port: int | None = None, lifespan: str = "off") -> None:
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        require_integration("a server")
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
