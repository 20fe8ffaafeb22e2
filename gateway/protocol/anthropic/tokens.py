"""An estimate of a Messages request's input tokens, for ``count_tokens`` where no tokenizer is at hand: about
four characters a token (English text and JSON with BPE tokenizers), plus a few tokens of framing a message."""

from __future__ import annotations

import math
from typing import Any

import orjson

from gateway.protocol.anthropic.to_chat import block_text

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    total = 0
    for block in content or []:
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("text"), str):
            total += len(block["text"])
        elif block.get("type") == "thinking":
            total += len(block.get("thinking") or "")
        elif block.get("type") == "tool_result":
            total += _chars(block.get("content"))
        else:
            total += len(orjson.dumps(block.get("input", block)))
    return total


def estimate_tokens(body: dict[str, Any]) -> int:
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    chars = len(block_text(body.get("system"))) + sum(_chars(m.get("content")) for m in messages)
    if body.get("tools"):
        chars += len(orjson.dumps(body["tools"]))
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages))
