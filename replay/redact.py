"""Redaction: secrets and personal addresses are removed before anything leaves the store. Pure.

Each match becomes a placeholder naming what it was (``[REDACTED:email]``), so a model trained on the
export learns that something stood there, never what. Defaults cover API keys (OpenAI-style ``sk-…``,
this gateway's ``sk-harness-…``, AWS ``AKIA…``, GitHub ``ghp_…``/``github_pat_…``, Slack ``xox?-…``),
JWTs, private-key blocks, ``Authorization: Bearer …`` (and Basic) credentials, long values after
``api_key=``/``token=``/``secret:``/``password=`` and the like, and e-mail addresses. Extra patterns
come from the config (``store.redact_patterns``) or the command line; their matches become
``[REDACTED:custom]``.

A message whose text changed no longer matches the token ids captured for it, so callers drop those ids
(see ``replay.export``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# (label, pattern, group to replace: 0 = the whole match). Order matters: specific before generic, so a
# bearer token that is also a JWT is labelled once, and a key after "api_key=" is named by its own kind.
_DEFAULTS: list[tuple[str, str, int]] = [
    ("private_key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY-----", 0),
    # A credential in an Authorization header, whatever it looks like.
    ("bearer", r"(?i)\bauthorization\s*[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|digest)\s+([^\s\"',;]+)", 1),
    # "Bearer X" in prose: only when X looks like a token (a digit in it, or long), not "bearer bonds".
    ("bearer", r"(?i)\bbearer\s+((?=[A-Za-z._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,}|[A-Za-z0-9._~+/=-]{20,})", 1),
    ("api_key", r"\bsk-harness-[A-Za-z0-9_-]{16,}", 0),
    ("api_key", r"\bsk-(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{20,}", 0),
    ("aws_key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0),
    ("github_token", r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})", 0),
    ("slack_token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}", 0),
    ("jwt", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}", 0),
    # A long key-like value (a digit in it: hex, base64) after api_key=, token: and their kin.
    ("secret", r"(?i)\b(?:api[_-]?key|apikey|access[_-]?key|secret[_-]?key|client[_-]?secret|secret|"
               r"access[_-]?token|auth[_-]?token|refresh[_-]?token|token)"
               r"\s*[\"']?\s*[:=]\s*[\"']?((?=[A-Za-z_\-+/=.~]*\d)[A-Za-z0-9_\-+/=.~]{12,})", 1),
    # Passwords need not look random: any value after password= / passwd: / pwd=.
    ("password", r"(?i)\b(?:password|passwd|pwd)\s*[\"']?\s*[:=]\s*[\"']?(?!\[REDACTED)([^\s\"',;]{4,})", 1),
    ("email", r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b", 0),
]

# Every default pattern's match contains one of these literals (case aside), and none of them holds a
# character JSON escapes, so a stored JSON body without any of them cannot need redacting: the common case
# skips decoding entirely. (Searching the lowered bytes is several times faster than a (?i) pattern.)
_TRIGGERS = re.compile(rb"@|sk-|key|token|bearer|secret|passw|pwd|authorization|akia|asia|gh[pousr]_|github_pat_|"
                       rb"xox|eyj")


@dataclass(frozen=True)
class _Rule:
    label: str
    regex: re.Pattern[str]
    group: int


class Redactor:
    """Replaces matches of the default and extra patterns in every string of a JSON-like value."""

    def __init__(self, *, defaults: bool = True, patterns: Iterable[str] = ()) -> None:
        rules = [_Rule(label, re.compile(p), g) for label, p, g in _DEFAULTS] if defaults else []
        self.custom = False
        for pattern in patterns:
            try:
                regex = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"redaction pattern {pattern!r} is not a valid regular expression: {exc}") from None
            rules.append(_Rule("custom", regex, 0))
            self.custom = True
        self.rules = rules

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def may_match(self, raw_json: bytes) -> bool:
        """False only when the JSON-encoded value certainly holds nothing to redact (a cheap pre-check)."""
        if not self.rules:
            return False
        if self.custom:
            return True
        return _TRIGGERS.search(raw_json.lower()) is not None

    def text(self, value: str) -> str:
        for rule in self.rules:
            if rule.group == 0:
                value = rule.regex.sub(f"[REDACTED:{rule.label}]", value)
            else:
                value = rule.regex.sub(lambda m, r=rule: _replace_group(m, r), value)
        return value

    def value(self, value: Any) -> tuple[Any, bool]:
        """``value`` with every string redacted (keys are left alone), and whether anything changed."""
        if isinstance(value, str):
            out = self.text(value)
            return out, out != value
        if isinstance(value, list):
            changed = False
            items = []
            for item in value:
                new, c = self.value(item)
                items.append(new)
                changed |= c
            return (items, True) if changed else (value, False)
        if isinstance(value, dict):
            changed = False
            fields = {}
            for k, item in value.items():
                new, c = self.value(item)
                fields[k] = new
                changed |= c
            return (fields, True) if changed else (value, False)
        return value, False


def _replace_group(match: re.Match[str], rule: _Rule) -> str:
    # Keep what names the secret ("Bearer ", "api_key=") so the text still reads naturally.
    start, end = match.span(rule.group)
    whole_start = match.start()
    text = match.group(0)
    return text[:start - whole_start] + f"[REDACTED:{rule.label}]" + text[end - whole_start:]
