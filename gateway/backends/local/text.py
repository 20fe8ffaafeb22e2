"""The text of one generated sequence, released as it grows: whole characters only, and never a stop string."""

from __future__ import annotations

from typing import Any

from gateway.agent.parsing import partial_suffix_length


class TextTracker:
    """Incremental detokenization of one sequence, and its stop strings.

    Decodes a window of recent ids so multi-byte characters split across tokens are released only
    once complete, and holds back any end of the text that may be the start of a stop string.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
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
        out = self._text[self._released:limit]
        self._released = max(self._released, limit)
        return out, False

    def flush(self) -> str:
        """Release everything held, an incomplete last character included: the sequence has ended."""
        self._text += self._decode_step(final=True)
        out, self._released = self._text[self._released:], len(self._text)
        return out
