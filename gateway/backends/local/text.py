"""The text of one generated sequence, released as it grows: whole characters only, and never a stop string.

With tools offered, a sequence also ends once its calls are done: right after a ``</tool_call>`` that is
followed by anything but another ``<tool_call>`` (or, without parallel calls, right after the first), keeping the
closing tag so the call parses whole. Text a small model rambles on with after its call is never part of it.
"""

from __future__ import annotations

from typing import Any

from gateway.agent.parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, partial_suffix_length


class TextTracker:
    """Incremental detokenization of one sequence, and its stop strings.

    Decodes a window of recent ids so multi-byte characters split across tokens are released only
    once complete, and holds back any end of the text that may be the start of a stop string.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], tool_stop: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._tool_stop = tool_stop  # None | "first" | "last"
        self._calls_from = 0  # where to look for the next closing tag
        self._closed_at: int | None = None  # just after a closing tag whose continuation is not known yet
        self._stops = stops
        self._longest_stop = max((len(s) for s in stops), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to text already counted
        self._read = 0
        self._text = ""
        self._released = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_step(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token: (text to release, whether a stop string ended the sequence)."""
        self._ids.append(token_id)
        searched_from = max(0, len(self._text) - self._longest_stop + 1)
        self._text += self._decode_step(final=False)
        if self._stops:
            hits = [i for i in (self._text.find(s, searched_from) for s in self._stops) if i != -1]
            if hits:
                self._text = self._text[:min(hits)]
                out, self._released = self._text[self._released:], len(self._text)
                return out, True
        limit = len(self._text) - partial_suffix_length(self._text, self._stops)
        if self._tool_stop and self._calls_done():
            self._text = self._text[:self._closed_at]
            out, self._released = self._text[self._released:], len(self._text)
            return out, True
        if self._closed_at is not None:
            limit = min(limit, self._closed_at)
        out = self._text[self._released:limit]
        self._released = max(self._released, limit)
        return out, False

    def _calls_done(self) -> bool:
        """Whether the text has gone past its last call; ``_closed_at`` is then where it ends."""
        while True:
            if self._closed_at is None:
                end = self._text.find(TOOL_CALL_CLOSE, self._calls_from)
                if end == -1:
                    self._calls_from = max(self._calls_from, len(self._text) - len(TOOL_CALL_CLOSE) + 1)
                    return False
                self._closed_at = end + len(TOOL_CALL_CLOSE)
                if self._tool_stop == "first":
                    return True
            rest = self._text[self._closed_at:].lstrip()
            if not rest or TOOL_CALL_OPEN.startswith(rest):
                return False  # maybe another call: wait and see
            if not rest.startswith(TOOL_CALL_OPEN):
                return True
            self._calls_from, self._closed_at = self._closed_at, None

    def flush(self) -> str:
        """Release everything held, an incomplete last character included: the sequence has ended."""
        self._text += self._decode_step(final=True)
        out, self._released = self._text[self._released:], len(self._text)
        return out
