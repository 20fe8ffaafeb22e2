"""``/v1/responses`` and ``/v1/responses/compact`` passed through to a Responses-native upstream
(``kind = "openai-responses"``): Codex's requests reach a hosted model as Codex sent them, and its answers come back
as the model made them (``api/passthrough.py`` does the I/O).

The call is recorded twice over: in the chat format every reader of the store takes (the input items translated as
for a chat backend, leniently, since the upstream may hold what a request refers to; the output as one assistant
message, readable reasoning as ``reasoning_content``), and whole in ``native``, reasoning items with their
``encrypted_content``, custom tool calls and compaction items as they came. A session's calls are stitched by
Codex's ``prompt_cache_key`` (its thread id) as any Responses call is, across its compactions too.

The proxy guard is check-only here: a backend call's invalid tool calls are recorded as such, never sent back to
the model, because a retry would replay reasoning the upstream signed for the first attempt; answers say so in an
``X-Harness-Guard: check-only`` header.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response

from gateway.agent import guard
from gateway.agent.validation import function_schemas
from gateway.api.exchange import Exchange
from gateway.api.passthrough import pass_through
from gateway.backends.openai_responses import ResponsesBackend
from gateway.context import RequestContext
from gateway.protocol.responses import ToolMap
from gateway.protocol.responses.native import FINAL_EVENTS, ResponseAccumulator, is_output_event, response_to_chat
from gateway.protocol.sse import encode_named_event
from replay.records import CallRecord, Statement

API = "responses"
RESPONSES_PATH = "/responses"
COMPACT_PATH = "/responses/compact"
GUARD_HEADER = "X-Harness-Guard"


class _ResponsesReader:
    """The Responses API's side of a pass-through (see ``passthrough.Reader``)."""

    held = FINAL_EVENTS

    def __init__(self, ctx: RequestContext, request: dict[str, Any], tool_map: ToolMap,
                 statements: Callable[[dict[str, Any]], list[Statement]]) -> None:
        self.ctx = ctx
        self.request = request
        self.tool_map = tool_map
        self._statements = statements
        self.acc = ResponseAccumulator()

    def add(self, event: dict[str, Any]) -> None:
        self.acc.add(event)

    def is_output(self, kind: str | None) -> bool:
        return is_output_event(kind)

    @property
    def answer(self) -> dict[str, Any] | None:
        return self.acc.response

    def failure(self) -> str | None:
        error = self.acc.error
        return None if error is None else f"upstream stream error: {error.get('code')}: {error.get('message')}"

    def record(self, exchange: Exchange, answer: dict[str, Any] | None, *, status: str,
               error: str | None) -> CallRecord:
        native = {"api": API, "request": self.request, "response": answer}
        if answer is None:
            return exchange.record(status="error" if status == "ok" else status, native=native,
                                   error=error or "the upstream's stream ended before its response began")
        completion = response_to_chat(answer, self.tool_map)
        return exchange.record(status=status, response=completion, error=error, native=native,
                               tool_calls=self._checked(completion))

    def _checked(self, completion: dict[str, Any]) -> list[dict[str, Any]]:
        """The answer's tool calls checked against their schemas, for the record alone."""
        schemas = function_schemas(self.tool_map.chat_tools)
        if not schemas:
            return []
        checked = guard.check_message(completion["choices"][0]["message"], schemas)
        invalid = sum(not c.valid for c in checked)
        if invalid:
            self.ctx.line.invalid_tool_calls = invalid
        return guard.tool_rows(checked, "returned")

    def statements(self, answer: dict[str, Any]) -> list[Statement]:
        return self._statements(answer)

    def error_event(self, status: int, message: str) -> bytes:
        code = "rate_limit_exceeded" if status == 429 else "server_error"
        return encode_named_event("error", {"type": "error", "code": code, "message": message, "param": None})


async def pass_through_response(ctx: RequestContext, exchange: Exchange, backend: ResponsesBackend, raw: bytes,
                                body: dict[str, Any], asked_model: Any, tool_map: ToolMap,
                                statements: Callable[[dict[str, Any]], list[Statement]], *,
                                compact: bool = False) -> Response:
    """Answer a Responses request (``compact``: a ``/responses/compact`` one) from the native upstream. Its bytes go
    as they came unless routing named another model than ``asked_model`` (an alias): then the upstream is sent the
    request with its own model name, every other value as it was."""
    target = exchange.target.base
    if asked_model != target:
        raw = orjson.dumps({**body, "model": target})
    exchange.labels = {**exchange.labels, "api": API, "guard": "check-only"}
    reader = _ResponsesReader(ctx, body, tool_map, statements)
    return await pass_through(ctx, exchange, backend, COMPACT_PATH if compact else RESPONSES_PATH, raw, reader,
                              stream=bool(body.get("stream")) and not compact, headers={GUARD_HEADER: "check-only"})
