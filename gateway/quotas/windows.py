"""The windows limits count in (UTC clock minutes, days and months), and how a wait is written in OpenAI's
``x-ratelimit-reset-*`` headers. Pure: the time is passed in."""

from __future__ import annotations

import calendar
from datetime import UTC, datetime
from typing import Literal

Span = Literal["minute", "day", "month"]


def window(span: Span, now: float) -> tuple[str, float]:
    """The window ``now`` falls in: its name (part of a counter's key) and the time it ends."""
    if span == "minute":
        start = now - now % 60
        return f"m{int(start) // 60}", start + 60
    day = datetime.fromtimestamp(now, UTC)
    if span == "day":
        start = calendar.timegm((day.year, day.month, day.day, 0, 0, 0))
        return f"d{day:%Y%m%d}", float(start + 86400)
    following = (day.year + day.month // 12, day.month % 12 + 1)
    return f"M{day:%Y%m}", float(calendar.timegm((*following, 1, 0, 0, 0)))


def duration(seconds: float) -> str:
    """A wait as OpenAI's headers write it: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = int(seconds + 0.999)  # a wait is never reported shorter than it is
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
