"""A Responses exchange passed through to a Responses-native upstream, read for the record: the stream's events
gathered into the response they end in, and that response as the chat completion every reader of the store takes.

Nothing here changes what reaches the client (its bytes go on as they came); the record keeps the exchange whole
beside the chat form, so reasoning items and their ``encrypted_content``, custom tool calls and compaction items
are all there for an export that wants them.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.responses.from_chat import output_to_chat_messages
from gateway.protocol.responses.to_chat import _text_of
from gateway.protocol.responses.tools import ToolMap

# The events a stream ends with: relayed only once the exchange is recorded.
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
_SNAPSHOTS = frozenset({"response.created", "response.in_progress", "response.queued"}) | FINAL_EVENTS


def is_output_event(kind: str | None) -> bool:
    """Whether an event carries generated output: the first one marks the time to first token."""
    return bool(kind) and kind.startswith("response.") and kind.endswith(".delta")


class ResponseAccumulator:
    """A Responses event stream, read along: ``response`` is the response as it stands (the last snapshot the stream
    sent, with the output items finished so far when the snapshot has none), ``error`` what a failure said."""

    def __init__(self) -> None:
        self._snapshot: dict[str, Any] | None = None
        self._items: dict[int, dict[str, Any]] = {}
        self.error: dict[str, Any] | None = None

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in _SNAPSHOTS and isinstance(event.get("response"), dict):
            self._snapshot = event["response"]
        if kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            index = event.get("output_index")
            self._items[index if isinstance(index, int) else len(self._items)] = event["item"]
        elif kind == "response.failed":
            self.error = (self._snapshot or {}).get("error") or {"message": "the upstream's response failed"}
        elif kind == "error":
            self.error = {k: event.get(k) for k in ("code", "message", "param")}

    @property
    def response(self) -> dict[str, Any] | None:
        if self._snapshot is None:
            return None
        output = self._snapshot.get("output") or [self._items[i] for i in sorted(self._items)]
        return {**self._snapshot, "output": output}


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": int(usage.get("total_tokens") or prompt + completion),
            "prompt_tokens_details": {
                "cached_tokens": int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)},
            "completion_tokens_details": {
                "reasoning_tokens": int((usage.get("output_tokens_details") or {}).get("reasoning_tokens") or 0)}}


def _reasoning_text(output: list[Any]) -> str:
    """What a reasoning item lets be read: its summary, or its content where the upstream shows it."""
    parts = [part.get("text") for item in output if isinstance(item, dict) and item.get("type") == "reasoning"
             for part in (item.get("summary") or item.get("content") or ()) if isinstance(part, dict)]
    return "\n\n".join(p for p in parts if isinstance(p, str) and p)


def response_to_chat(response: dict[str, Any], tool_map: ToolMap) -> dict[str, Any]:
    """A Responses ``response`` as a ``chat.completion``: its messages and calls as one assistant message (tools by
    the names ``tool_map`` gave them), readable reasoning as ``reasoning_content``, the usage in chat's terms."""
    output = [item for item in response.get("output") or () if isinstance(item, dict)]
    messages = [m for m in output_to_chat_messages({"output": output}, tool_map) if m.get("role") == "assistant"]
    texts = [_text_of(m.get("content")) for m in messages]
    calls = [call for m in messages for call in m.get("tool_calls") or ()]
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(t for t in texts if t) or None}
    if calls:
        message["tool_calls"] = calls
    reasoning = _reasoning_text(output)
    if reasoning:
        message["reasoning_content"] = reasoning
    incomplete = (response.get("incomplete_details") or {}).get("reason")
    finish = ("tool_calls" if calls else "length" if incomplete == "max_output_tokens"
              else "content_filter" if incomplete == "content_filter" else "stop")
    completion: dict[str, Any] = {"id": response.get("id"), "object": "chat.completion",
                                  "created": response.get("created_at"), "model": response.get("model"),
                                  "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
    usage = _usage(response.get("usage"))
    if usage is not None:
        completion["usage"] = usage
    return completion
