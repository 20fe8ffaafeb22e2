"""A stand-in OpenAI-compatible upstream for tests: a small ASGI app on a loopback port.

Its behaviour is chosen by the last user message, so a test steers it through the real gateway:
``status:503`` answers that status, ``slow:2`` waits two seconds, ``garbage`` answers non-JSON,
``flaky`` fails the first attempt of each distinct request, ``stall`` streams one chunk then hangs,
``tool`` answers with a tool call, ``deep:N`` adds a field nested N levels to its answer, ``overflow`` counts more
tokens than an SQLite integer holds; anything else is echoed back as ``echo: <text>``.
Every request it receives is kept in ``calls``. It serves legacy completions (the prompt echoed, steered by the
prompt alike) and embeddings (small vectors made from each input's position) too.

A test may also steer one stand-in apart from another serving the same model: ``delay`` seconds before every
answer, ``failure`` (a status and a JSON body) answered to every request after the first ``fail_after``, and to
``GET /v1/models`` (its health check) too, once those have come, while it is a 5xx.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
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
        self.delay = 0.0
        self.failure: tuple[int, dict[str, Any]] | None = None
        self.fail_after = 0
        self.health_checks = 0
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/v1/models", self.models, methods=["GET"]),
                                     Route("/v1/completions", self.completions, methods=["POST"]),
                                     Route("/v1/embeddings", self.embeddings, methods=["POST"])])

    async def models(self, request: Request) -> Response:
        self.health_checks += 1
        if self.failure is not None and self.failure[0] >= 500 and len(self.calls) >= self.fail_after:
            return Response(orjson.dumps(self.failure[1]), status_code=self.failure[0], media_type="application/json")
        return Response(orjson.dumps({"object": "list", "data": [{"id": "stand-in-model", "object": "model"}]}),
                        media_type="application/json")

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.calls.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.failure is not None and len(self.calls) > self.fail_after:
            return Response(orjson.dumps(self.failure[1]), status_code=self.failure[0], media_type="application/json")
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


    async def completions(self, request: Request) -> Response:
        """Legacy completions: each prompt (text, or token ids shown as a list) echoed back, ``n`` times;
        ``status:N`` answers that status, ``stall`` streams one chunk then hangs."""
        body = orjson.loads(await request.body())
        self.calls.append(body)
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        command, _, arg = str(prompts[0]).partition(":")
        if command == "status":
            return _failure(int(arg))
        texts = [f"echo: {p}" for p in prompts for _ in range(body.get("n") or 1)]
        usage = {"prompt_tokens": 10, "completion_tokens": 3 * len(texts), "total_tokens": 10 + 3 * len(texts)}
        base = {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model")}
        if not body.get("stream"):
            return Response(orjson.dumps({**base, "choices": [
                {"index": i, "text": text, "logprobs": None, "finish_reason": "stop"} for i, text in enumerate(texts)],
                "usage": usage}), media_type="application/json")
        return StreamingResponse(self._text_stream(base, texts, usage, body, command), media_type="text/event-stream")

    async def _text_stream(self, base: dict[str, Any], texts: list[str], usage: dict[str, Any], body: dict[str, Any],
                           command: str):
        def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({**base, "choices": choices, **extra}) + b"\n\n"

        try:
            for i, text in enumerate(texts):
                for word in text.split(" "):
                    yield frame([{"index": i, "text": word + " ", "logprobs": None, "finish_reason": None}])
                    if command == "stall":
                        await asyncio.sleep(3600)
                    await asyncio.sleep(0)
                yield frame([{"index": i, "text": "", "logprobs": None, "finish_reason": "stop"}])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield frame([], usage=usage)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise

    async def embeddings(self, request: Request) -> Response:
        """A vector of ``dimensions`` (default 8) numbers per input, each its index plus a tenth of its position;
        ``status:N`` as the first input answers that status."""
        body = orjson.loads(await request.body())
        self.calls.append(body)
        given = body.get("input")
        inputs = given if isinstance(given, list) and given and not isinstance(given[0], int) else [given]
        command, _, arg = str(inputs[0]).partition(":")
        if command == "status":
            return _failure(int(arg))
        size = body.get("dimensions") or 8
        data = []
        for i in range(len(inputs)):
            vector = [i + k / 10 for k in range(size)]
            embedding: Any = vector
            if body.get("encoding_format") == "base64":
                embedding = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return Response(orjson.dumps({"object": "list", "data": data, "model": body.get("model"),
                                      "usage": {"prompt_tokens": 2 * len(inputs), "total_tokens": 2 * len(inputs)}}),
                        media_type="application/json")


def _failure(status: int) -> Response:
    return Response(orjson.dumps({"error": {"message": f"stand-in failure {status}", "type": "server_error",
                                            "param": None, "code": None}}),
                    status_code=status, media_type="application/json")


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
