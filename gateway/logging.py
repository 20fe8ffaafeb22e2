"""structlog set-up: JSON lines in production, readable lines on a terminal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the moment: test runners and CLI runners swap it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _add_pid(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    # Which process wrote the line: with [server] workers above 1, several gateway processes share one log.
    event["pid"] = os.getpid()
    return event


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_pid,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # The line and its newline in one write: print() writes them apart, and the processes of [server] workers
        # share one stderr, so their lines would run together.
        logger_factory=structlog.WriteLoggerFactory(_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
