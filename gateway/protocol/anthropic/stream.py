"""Chat-completion chunks as Anthropic's stream events: ``message_start``, ``ping``, then a content block at a time
(``content_block_start``, its deltas, ``content_block_stop``), ``message_delta`` with the stop reason and usage,
and ``message_stop``.

A block is open until output of another kind (or another tool call) arrives: thinking as ``thinking_delta``s,
text as ``text_delta``s, each tool call as ``input_json_delta``s of its arguments as the backend streamed them.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.anthropic.from_chat import stop_reason, tool_input, usage_of


class MessageStream:
    def __init__(self, *, message_id: str, model: str, stop_sequences: list[str] | None = None) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = stop_sequences
        self.blocks: list[dict[str, Any]] = []
        self._open: tuple[str, Any] | None = None  # ("thinking" | "text", None) or ("tool_use", the chat index)
        self._arguments: dict[int, str] = {}  # per block index: a tool call's argument text so far
        self._finish: str | None = None
        self._matched: Any = None
        self._usage: dict[str, Any] | None = None

    def start(self) -> list[dict[str, Any]]:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                events += self._delta(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""},
                                      {"type": "thinking_delta", "thinking": reasoning})
            if isinstance(delta.get("content"), str) and delta["content"]:
                events += self._delta(("text", None), {"type": "text", "text": ""},
                                      {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self._matched = choice.get("matched_stop", choice.get("stop_reason"))
        return events

    def _delta(self, kind: tuple[str, Any], start: dict[str, Any], delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = [] if self._open == kind else self._switch(kind, start)
        block = self.blocks[-1]
        if delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif delta["type"] == "text_delta":
            block["text"] += delta["text"]
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        kind = ("tool_use", call.get("index", 0))
        function = call.get("function") or {}
        events: list[dict[str, Any]] = []
        if self._open != kind:
            events += self._switch(kind, {"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                                          "input": {}})
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            index = len(self.blocks) - 1
            self._arguments[index] = self._arguments.get(index, "") + fragment
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": fragment}})
        return events

    def _switch(self, kind: tuple[str, Any], start: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._open = kind
        self.blocks.append(dict(start))
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def finish(self) -> list[dict[str, Any]]:
        events = self._close()
        message = self.message
        usage = message["usage"]
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                       "usage": {"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
                                 "cache_read_input_tokens": usage["cache_read_input_tokens"]}})
        events.append({"type": "message_stop"})
        return events

    def error(self, error_type: str, message: str) -> list[dict[str, Any]]:
        return [{"type": "error", "error": {"type": error_type, "message": message}}]

    @property
    def message(self) -> dict[str, Any]:
        """The Message streamed so far, whole."""
        content = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": tool_input(self._arguments.get(index, ""))}
            content.append(block)
        reason, sequence = stop_reason(self._finish, self._matched, self.stop_sequences)
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content or [{"type": "text", "text": ""}], "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage_of(self._usage)}
