"""Reading an Anthropic upstream's stream while passing it on: events split from the bytes as they come, each kept
byte for byte (``protocol.sse.parse_events``), and the Message they build, for the record.

Unknown event, block and delta types are kept as they came (a block) or skipped (a delta): what a new release
adds reaches the client untouched either way, since the bytes go on as they are.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.anthropic.from_chat import tool_input


class MessageAccumulator:
    def __init__(self) -> None:
        self._message: dict[str, Any] | None = None
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, str] = {}
        self.error: dict[str, Any] | None = None

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self._message = dict(event["message"])
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            self._blocks[int(event.get("index", len(self._blocks)))] = dict(event["content_block"])
        elif kind == "content_block_delta":
            self._delta(int(event.get("index", 0)), event.get("delta") or {})
        elif kind == "message_delta" and self._message is not None:
            self._message.update({k: v for k, v in (event.get("delta") or {}).items()
                                  if k in ("stop_reason", "stop_sequence")})
            self._message["usage"] = {**(self._message.get("usage") or {}), **(event.get("usage") or {})}
        elif kind == "error":
            self.error = event.get("error") if isinstance(event.get("error"), dict) else {"message": str(event)}

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self._blocks.get(index)
        if block is None:
            return
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = (block.get("text") or "") + (delta.get("text") or "")
        elif kind == "thinking_delta":
            block["thinking"] = (block.get("thinking") or "") + (delta.get("thinking") or "")
        elif kind == "signature_delta":
            block["signature"] = (block.get("signature") or "") + (delta.get("signature") or "")
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + (delta.get("partial_json") or "")

    @property
    def message(self) -> dict[str, Any] | None:
        if self._message is None:
            return None
        content = []
        for index in sorted(self._blocks):
            block = self._blocks[index]
            if index in self._json:
                block = {**block, "input": tool_input(self._json[index])}
            content.append(block)
        return {**self._message, "content": content}
