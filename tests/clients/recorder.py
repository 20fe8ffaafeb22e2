"""A recording stand-in for learning what a client CLI sends: logs every request (headers and body) as JSON
files and answers minimally — a Responses SSE stream on ``/v1/responses``, a chat-completions stream on
``/v1/chat/completions``, both saying "ok". With ``--command``, a request with no tool result in its
history is answered instead with a call of the command tool (``exec_command {"cmd"}`` on the Responses
API for Codex, ``run_commands {"commands"}`` on chat completions for Cline), so the follow-up request
shows how each client sends a tool result back.

    python -m tests.clients.recorder --port 8765 --out /tmp/recorded [--command "echo hi > marker.txt"]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def responses_stream(text: str, model: str) -> list[bytes]:
    """The smallest Responses stream Codex accepts: created, one message item, completed with usage."""
    rid = "resp_recorder"
    item = {"type": "message", "id": "msg_recorder", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 11}
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model}
    return [
        _sse({"type": "response.created", "response": {**base, "status": "in_progress", "output": []}}),
        _sse({"type": "response.output_item.added", "output_index": 0,
              "item": {**item, "status": "in_progress", "content": []}}),
        _sse({"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
              "item_id": item["id"], "delta": text}),
        _sse({"type": "response.output_item.done", "output_index": 0, "item": item}),
        _sse({"type": "response.completed", "response": {**base, "status": "completed", "output": [item],
                                                         "usage": usage}}),
    ]


def responses_call_stream(name: str, arguments: str, call_id: str, model: str) -> list[bytes]:
    """A Responses stream whose only output is one function call."""
    rid = "resp_recorder_call"
    done = {"type": "function_call", "id": "fc_recorder", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model}
    return [
        _sse({"type": "response.created", "response": {**base, "status": "in_progress", "output": []}}),
        _sse({"type": "response.output_item.added", "output_index": 0,
              "item": {**done, "arguments": "", "status": "in_progress"}}),
        _sse({"type": "response.function_call_arguments.delta", "output_index": 0, "item_id": done["id"],
              "delta": arguments}),
        _sse({"type": "response.function_call_arguments.done", "output_index": 0, "item_id": done["id"],
              "arguments": arguments}),
        _sse({"type": "response.output_item.done", "output_index": 0, "item": done}),
        _sse({"type": "response.completed", "response": {**base, "status": "completed", "output": [done],
                                                         "usage": usage}}),
    ]


def chat_call_stream(name: str, arguments: str, call_id: str, model: str) -> list[bytes]:
    base = {"id": "chatcmpl-recorder-call", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def frame(choices: list[Any], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**base, "choices": choices, **extra}) + b"\n\n"

    return [
        frame([{"index": 0, "delta": {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            "finish_reason": None}]),
        frame([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
        frame([], usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}),
        b"data: [DONE]\n\n",
    ]


def chat_stream(text: str, model: str) -> list[bytes]:
    base = {"id": "chatcmpl-recorder", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def frame(choices: list[Any], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**base, "choices": choices, **extra}) + b"\n\n"

    return [
        frame([{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]),
        frame([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
        frame([], usage={"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}),
        b"data: [DONE]\n\n",
    ]


class Recorder:
    def __init__(self, out: Path, command: str | None = None) -> None:
        self.out = out
        self.command = command
        out.mkdir(parents=True, exist_ok=True)
        self.counter = itertools.count(1)
        self.app = Starlette(routes=[
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/{path:path}", self.other, methods=["GET", "POST", "PUT", "DELETE"]),
        ])

    async def _record(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = raw.decode(errors="replace")
        n = next(self.counter)
        entry = {"method": request.method, "path": request.url.path, "query": str(request.url.query),
                 "headers": dict(request.headers), "body": body}
        (self.out / f"{n:03d}{request.url.path.replace('/', '_')}.json").write_bytes(
            orjson.dumps(entry, option=orjson.OPT_INDENT_2))
        return body if isinstance(body, dict) else {}

    async def responses(self, request: Request) -> Response:
        body = await self._record(request)
        model = body.get("model", "m")
        answered = any(i.get("type") == "function_call_output" for i in body.get("input") or [])
        if self.command and not answered:
            frames = responses_call_stream("exec_command", orjson.dumps({"cmd": self.command}).decode(),
                                           "call_recorder_1", model)
        else:
            frames = responses_stream("ok", model)
        return StreamingResponse(iter(frames), media_type="text/event-stream")

    async def chat(self, request: Request) -> Response:
        body = await self._record(request)
        model = body.get("model", "m")
        answered = any(m.get("role") == "tool" for m in body.get("messages") or [])
        if self.command and not answered:
            frames = chat_call_stream("run_commands", orjson.dumps({"commands": [self.command]}).decode(),
                                      "call_recorder_1", model)
        else:
            frames = chat_stream("ok", model)
        return StreamingResponse(iter(frames), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"object": "list", "data": [{"id": "stand-in-model", "object": "model",
                                                         "owned_by": "recorder"}]})

    async def other(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"error": {"message": "not here", "type": "not_found"}}, status_code=404)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", help="first answer a call of the client's command tool with this")
    args = parser.parse_args()
    uvicorn.run(Recorder(args.out, args.command).app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
