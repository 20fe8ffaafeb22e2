"""The stand-in model behind the gateway for the client CLI tests: a chat-completions server that drives
a coding agent through one shell command and then finishes.

The gateway translates whatever the client speaks (chat completions for Cline, the Responses API for
Codex) into chat completions, so this server only answers ``POST /v1/chat/completions``, plain or
streamed. Its script, per request:

* no ``tool`` message in the history yet: call the command-execution tool the request offers (found
  by name, its arguments shaped by that tool's JSON Schema) with the configured shell command;
* a ``tool`` message present: answer with the final text ``done``;
* no tools offered at all (the gateway's summary of a history it compacts): answer with ``SUMMARY_TEXT``.

``first_prompt_tokens``: the prompt tokens the first answer reports (a large number makes Codex compact).

Every request body it receives is kept in ``calls``, and each answer in ``answers``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

CALL_ID = "call_scripted_1"
FINAL_TEXT = "done"
SUMMARY_TEXT = "Summary: the command was asked for; nothing else happened."

# Command tools in the order they are preferred, as the clients name them.
COMMAND_TOOLS = ("exec_command", "run_commands", "shell", "local_shell", "execute_command", "run_command",
                 "bash", "Bash", "run_shell_command")


class ScriptError(Exception):
    """The request does not offer a tool this script can drive."""


def tool_specs(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The request's function tools by name, with their parameter schemas."""
    out: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        fn = tool.get("function") if tool.get("type") == "function" else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def command_arguments(schema: dict[str, Any], command: str) -> dict[str, Any]:
    """Arguments for a command tool that carry ``command``, in the shape its schema asks for."""
    props = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    args: dict[str, Any] = {}
    for name in ("cmd", "command", "commands"):
        prop = props.get(name)
        if prop is None:
            continue
        kind = prop.get("type")
        if kind == "string":
            args[name] = command
        elif kind == "array":
            item = (prop.get("items") or {}).get("type")
            # An argv array (["bash", "-lc", ...]) when it holds one command; a list of commands otherwise.
            args[name] = [command] if name == "commands" or item != "string" else ["bash", "-lc", command]
        else:
            continue
        break
    if not args:
        raise ScriptError(f"no command property in schema {json.dumps(schema)[:500]}")
    missing = [r for r in required if r not in args]
    if missing:
        raise ScriptError(f"command tool also requires {missing}, which this script cannot fill")
    return args


def pick_command_tool(body: dict[str, Any], command: str) -> tuple[str, dict[str, Any]]:
    specs = tool_specs(body)
    for name in COMMAND_TOOLS:
        if name in specs:
            return name, command_arguments(specs[name], command)
    raise ScriptError(f"no command tool among the offered tools {sorted(specs)}")


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body.get("messages") or [] if m.get("role") == "tool"]


class ScriptedUpstream:
    def __init__(self, command: str, model: str = "stand-in-model", first_prompt_tokens: int | None = None) -> None:
        self.command = command
        self.model = model
        self.first_prompt_tokens = first_prompt_tokens
        self.calls: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    def answer_for(self, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The assistant message for this request, and its finish reason."""
        if tool_results(body):
            return {"role": "assistant", "content": FINAL_TEXT}, "stop"
        if not body.get("tools"):
            return {"role": "assistant", "content": SUMMARY_TEXT}, "stop"
        name, args = pick_command_tool(body, self.command)
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": CALL_ID, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}]}, "tool_calls"

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.calls.append(body)
        try:
            message, finish = self.answer_for(body)
        except ScriptError as exc:
            self.errors.append(str(exc))
            return Response(orjson.dumps({"error": {"message": f"scripted upstream: {exc}",
                                                    "type": "invalid_request_error", "param": "tools",
                                                    "code": None}}),
                            status_code=400, media_type="application/json")
        self.answers.append(message)
        prompt = self.first_prompt_tokens if self.first_prompt_tokens and len(self.calls) == 1 else None
        usage = {"prompt_tokens": prompt or 100 + 10 * len(self.calls), "completion_tokens": 7, "total_tokens": 0}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        base = {"id": f"chatcmpl-scripted-{len(self.calls)}", "created": int(time.time()),
                "model": body.get("model") or self.model}
        if not body.get("stream"):
            return Response(orjson.dumps({**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}], "usage": usage}),
                media_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._stream(base, message, finish, usage, include_usage),
                                 media_type="text/event-stream")

    @staticmethod
    async def _stream(base: dict[str, Any], message: dict[str, Any], finish: str, usage: dict[str, Any],
                      include_usage: bool):
        chunk = {**base, "object": "chat.completion.chunk"}

        def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({**chunk, "choices": choices, **extra}) + b"\n\n"

        yield frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            yield frame([{"index": 0, "delta": {"tool_calls": [{
                "index": 0, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}]}, "finish_reason": None}])
            args = call["function"]["arguments"]
            for i in range(0, len(args), 8):
                yield frame([{"index": 0, "delta": {"tool_calls": [{
                    "index": 0, "function": {"arguments": args[i:i + 8]}}]}, "finish_reason": None}])
        else:
            text = message["content"]
            for part in (text[:len(text) // 2], text[len(text) // 2:]):
                yield frame([{"index": 0, "delta": {"content": part}, "finish_reason": None}])
        yield frame([{"index": 0, "delta": {}, "finish_reason": finish}])
        if include_usage:
            yield frame([], usage=usage)
        yield b"data: [DONE]\n\n"
