"""A stand-in Responses API upstream (``POST /v1/responses``, plain and streamed, and ``POST /v1/responses/compact``)
for the pass-through tests and the Codex CLI runs.

Its answers carry what a faithful proxy must not touch: a ``reasoning`` item whose ``encrypted_content`` is an
opaque blob unique to the answer, custom tool calls, compaction items of its own making, and, when streamed, framing
a byte-for-byte relay must keep (an SSE comment, ``\\r\\n`` line ends on one event, an event split across two
writes). Its script, per request:

* input ending with a ``compaction_trigger``: exactly one ``compaction`` item (``/responses/compact``: the user
  messages and one compaction item);
* the last user message Codex's compaction prompt: a message holding ``SUMMARY``;
* no tool output after the last user message: reasoning, then a call of the shell tool the request offers
  (``exec_command`` with ``{"cmd": command}``), or of the custom ``apply_patch`` tool when ``patch`` is set;
* otherwise: reasoning, then the message ``FINAL_TEXT``.

``usage_tokens`` is the input tokens the first answer reports (a large number makes Codex compact after it; later
answers report 21). A last user message
``fail:STATUS`` gets that status with OpenAI's error body. Each request's path, headers and raw body are kept.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

FINAL_TEXT = "All done upstream."
SUMMARY = "Checkpoint: the marker file was written; nothing is left to do."
REASONING_SUMMARY = "The user wants a shell command run."
CHECKPOINT = "You are performing a CONTEXT CHECKPOINT COMPACTION"


def encrypted(n: int, kind: str = "rs") -> str:
    """An opaque blob as an upstream's encrypted content looks (base64, with + / and padding), unique per answer."""
    return f"gAAAAABp{kind}{n:04d}+Zx/9Qk=q3R+opaque/{n}+blob=="


def _event(kind: str, data: dict[str, Any], *, crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    return b"event: " + kind.encode() + end + b"data: " + orjson.dumps(data) + end + end


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or () if isinstance(p, dict))


class ResponsesUpstream:
    def __init__(self, command: str = "echo hi", *, patch: str | None = None, usage_tokens: int = 21) -> None:
        self.command = command
        self.patch = patch
        self.usage_tokens = usage_tokens
        self.requests: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []
        self.errors: list[str] = []  # as the scripted chat upstream keeps them: this script has none
        self.app = Starlette(routes=[Route("/v1/responses", self.responses, methods=["POST"]),
                                     Route("/v1/responses/compact", self.compact, methods=["POST"])])

    def _record(self, request: Request, raw: bytes) -> dict[str, Any]:
        body = orjson.loads(raw)
        self.requests.append({"path": request.url.path, "headers": dict(request.headers), "raw": raw, "body": body})
        return body

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The request bodies, in order."""
        return [r["body"] for r in self.requests]

    def _usage(self) -> dict[str, Any]:
        tokens = self.usage_tokens if len(self.requests) == 1 else 21
        return {"input_tokens": tokens, "input_tokens_details": {"cached_tokens": 4},
                "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": tokens + 9}

    def output(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        n = len(self.requests)
        items = body.get("input") if isinstance(body.get("input"), list) else [
            {"type": "message", "role": "user", "content": body.get("input") or ""}]
        if items and items[-1].get("type") == "compaction_trigger":
            return [{"id": f"cmp_up_{n}", "type": "compaction", "encrypted_content": encrypted(n, "cmp")}]
        last_user = max((i for i, item in enumerate(items) if item.get("role") == "user"), default=-1)
        if last_user >= 0 and _text(items[last_user].get("content")).startswith(CHECKPOINT):
            return [self._message(n, SUMMARY)]
        reasoning = {"id": f"rs_up_{n}", "type": "reasoning", "encrypted_content": encrypted(n),
                     "summary": [{"type": "summary_text", "text": REASONING_SUMMARY}]}
        answered = any(item.get("type", "").endswith("_call_output") for item in items[last_user + 1:])
        if answered:
            return [reasoning, self._message(n, FINAL_TEXT)]
        tools = {t.get("name"): t for t in body.get("tools") or () if isinstance(t, dict)}
        if self.patch is not None and tools.get("apply_patch", {}).get("type") == "custom":
            return [reasoning, {"id": f"ctc_up_{n}", "type": "custom_tool_call", "status": "completed",
                                "call_id": f"call_up_{n}", "name": "apply_patch", "input": self.patch}]
        if "exec_command" in tools:
            return [reasoning, {"id": f"fc_up_{n}", "type": "function_call", "status": "completed",
                                "call_id": f"call_up_{n}", "name": "exec_command",
                                "arguments": orjson.dumps({"cmd": self.command}).decode()}]
        return [reasoning, self._message(n, FINAL_TEXT)]

    @staticmethod
    def _message(n: int, text: str) -> dict[str, Any]:
        return {"id": f"msg_up_{n}", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _refusal(self, body: dict[str, Any]) -> Response | None:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        users = [_text(i.get("content")) for i in items if isinstance(i, dict) and i.get("role") == "user"]
        text = users[-1] if users else str(body.get("input") or "")
        if not text.startswith("fail:"):
            return None
        status = int(text.split(":", 1)[1])
        return Response(orjson.dumps({"error": {"message": f"upstream says {status}", "type": "invalid_request_error",
                                                "param": None, "code": "upstream_refused"}}),
                        status_code=status, media_type="application/json", headers={"x-request-id": "req_up_err"})

    async def responses(self, request: Request) -> Response:
        body = self._record(request, await request.body())
        refused = self._refusal(body)
        if refused is not None:
            return refused
        n = len(self.requests)
        response = {"id": f"resp_up_{n}", "object": "response", "created_at": 1_800_000_000 + n, "status": "completed",
                    "model": body.get("model"), "output": self.output(body), "usage": self._usage(),
                    "store": body.get("store", True), "prompt_cache_key": body.get("prompt_cache_key"),
                    "previous_response_id": body.get("previous_response_id"), "error": None,
                    "incomplete_details": None}
        self.answers.append(response)
        headers = {"x-request-id": f"req_up_{n}", "x-ratelimit-remaining-requests": "99"}
        if not body.get("stream"):
            return Response(orjson.dumps(response), media_type="application/json", headers=headers)
        return StreamingResponse(self._stream(response), media_type="text/event-stream", headers=headers)

    async def compact(self, request: Request) -> Response:
        body = self._record(request, await request.body())
        n = len(self.requests)
        users = [i for i in body.get("input") or () if isinstance(i, dict) and i.get("role") == "user"]
        answer = {"id": f"resp_up_{n}", "object": "response.compaction", "created_at": 1_800_000_000 + n,
                  "output": [*users, {"id": f"cmp_up_{n}", "type": "compaction",
                                      "encrypted_content": encrypted(n, "cmp")}], "usage": self._usage()}
        self.answers.append(answer)
        return Response(orjson.dumps(answer), media_type="application/json")

    @staticmethod
    async def _stream(response: dict[str, Any]) -> AsyncIterator[bytes]:
        seq = iter(range(10_000))
        start = {**response, "status": "in_progress", "output": [], "usage": None}
        yield _event("response.created", {"type": "response.created", "sequence_number": next(seq), "response": start})
        yield b": keep-alive comment\n\n"
        yield _event("response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq),
                                              "response": start}, crlf=True)
        for index, item in enumerate(response["output"]):
            opened = {**item, "status": "in_progress"} if "status" in item else item
            yield _event("response.output_item.added", {"type": "response.output_item.added",
                                                        "sequence_number": next(seq), "output_index": index,
                                                        "item": opened})
            if item["type"] == "message":
                text = item["content"][0]["text"]
                for part in (text[:5], text[5:]):
                    yield _event("response.output_text.delta", {
                        "type": "response.output_text.delta", "sequence_number": next(seq), "item_id": item["id"],
                        "output_index": index, "content_index": 0, "delta": part, "logprobs": []})
            done = _event("response.output_item.done", {"type": "response.output_item.done",
                                                       "sequence_number": next(seq), "output_index": index,
                                                       "item": item})
            yield done[:41]  # an event split across two writes, mid-way through
            yield done[41:]
        yield _event("response.completed", {"type": "response.completed", "sequence_number": next(seq),
                                            "response": response})
