"""A stand-in Anthropic Messages API upstream, for the passthrough tests: ``POST /v1/messages`` (plain and
streamed) and ``POST /v1/messages/count_tokens``.

Its answers carry what a faithful proxy must not touch: a thinking block with an opaque signature, a content
block type no release has yet (``future_block``), and, when streamed, the unusual framing a byte-for-byte relay
must keep (an SSE comment, a ``ping``, ``\\r\\n`` line ends on one event). Each request's headers, query and raw
body are kept in ``requests``. A last user message ``fail:STATUS`` gets that status with an Anthropic error body;
``overloaded-once`` is refused with 529 the first time it is seen and answered the second.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

SIGNATURE = "EqQBCkgIARABGAIiQL0x+sig/with=padding=="
FUTURE_BLOCK = {"type": "future_block", "payload": {"nested": [1, 2.50, "x"]}, "citations": None}
THINKING = "The user wants a greeting."
TEXT = "Hello from upstream."


def _event(kind: str, data: dict[str, Any], *, crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    return b"event: " + kind.encode() + end + b"data: " + orjson.dumps(data) + end + end


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict))
    return ""


class AnthropicUpstream:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._overloaded: set[str] = set()
        self.app = Starlette(routes=[Route("/v1/messages", self.messages, methods=["POST"]),
                                     Route("/v1/messages/count_tokens", self.count, methods=["POST"])])

    def message(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"id": f"msg_up_{len(self.requests)}", "type": "message", "role": "assistant",
                "model": body.get("model"), "content": [
                    {"type": "thinking", "thinking": THINKING, "signature": SIGNATURE}, FUTURE_BLOCK,
                    {"type": "text", "text": TEXT}],
                "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 21, "output_tokens": 9, "cache_read_input_tokens": 4,
                          "cache_creation_input_tokens": 0}}

    def _record(self, request: Request, raw: bytes) -> None:
        self.requests.append({"path": request.url.path, "query": request.url.query,
                              "headers": dict(request.headers), "raw": raw})

    def _refusal(self, body: dict[str, Any]) -> Response | None:
        text = _last_user_text(body)
        status = None
        if text.startswith("fail:"):
            status = int(text.split(":", 1)[1])
        elif text == "overloaded-once" and text not in self._overloaded:
            self._overloaded.add(text)
            status = 529
        if status is None:
            return None
        kind = "overloaded_error" if status == 529 else "invalid_request_error"
        return Response(orjson.dumps({"type": "error", "error": {"type": kind, "message": f"upstream says {status}"}}),
                        status_code=status, media_type="application/json", headers={"request-id": "req_up_err"})

    async def messages(self, request: Request) -> Response:
        raw = await request.body()
        self._record(request, raw)
        body = orjson.loads(raw)
        refused = self._refusal(body)
        if refused is not None:
            return refused
        message = self.message(body)
        headers = {"request-id": f"req_up_{len(self.requests)}", "anthropic-ratelimit-requests-remaining": "99"}
        if not body.get("stream"):
            return Response(orjson.dumps(message), media_type="application/json", headers=headers)
        return StreamingResponse(self._stream(message), media_type="text/event-stream", headers=headers)

    @staticmethod
    async def _stream(message: dict[str, Any]):
        start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 21, "output_tokens": 1}}
        yield _event("message_start", {"type": "message_start", "message": start})
        yield b": keep-alive comment\n\n"
        yield _event("ping", {"type": "ping"}, crlf=True)
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
        for part in (THINKING[:10], THINKING[10:]):
            yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "thinking_delta", "thinking": part}})
        # A signature split over two reads of the socket, mid-event.
        wire = _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "signature_delta", "signature": SIGNATURE}})
        yield wire[:37]
        yield wire[37:]
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield _event("content_block_start", {"type": "content_block_start", "index": 1, "content_block": FUTURE_BLOCK})
        yield _event("content_block_delta", {"type": "content_block_delta", "index": 1,
                                             "delta": {"type": "future_delta", "more": True}})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 1})
        yield _event("content_block_start", {"type": "content_block_start", "index": 2,
                                             "content_block": {"type": "text", "text": ""}})
        yield _event("content_block_delta", {"type": "content_block_delta", "index": 2,
                                             "delta": {"type": "text_delta", "text": TEXT}})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 2})
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                                           "stop_sequence": None},
                                       "usage": {"output_tokens": 9}})
        yield _event("message_stop", {"type": "message_stop"})

    async def count(self, request: Request) -> Response:
        raw = await request.body()
        self._record(request, raw)
        return Response(orjson.dumps({"input_tokens": 1234}), media_type="application/json")
