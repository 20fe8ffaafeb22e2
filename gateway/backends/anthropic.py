"""An Anthropic Messages API upstream, passed through (``passthrough.py``) for ``/v1/messages`` alone: thinking
signatures and block types this gateway has never heard of reach the client as they came.

The upstream's own key (``api_key_env``) goes as ``x-api-key``. The headers that shape the answer
(``anthropic-version``, ``anthropic-beta``) are forwarded; 529 (overloaded) is retried as 429 and 5xx are.
"""

from __future__ import annotations

from gateway.backends import upstream_http
from gateway.backends.passthrough import EventStream, PassThroughBackend

__all__ = ["AnthropicBackend", "EventStream"]

DEFAULT_VERSION = "2023-06-01"


class AnthropicBackend(PassThroughBackend):
    API = "Anthropic Messages API"
    SERVED_ON = "/v1/messages"
    FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
                         "x-claude-code-session-id", "user-agent", "x-app")
    ANSWER_HEADERS = ("content-type", "request-id", "retry-after")
    ANSWER_PREFIXES = ("anthropic-ratelimit-",)
    RETRY_STATUSES = upstream_http.RETRY_STATUSES | {529}  # 529: Anthropic's "overloaded"

    def base_headers(self) -> dict[str, str]:
        return {"content-type": "application/json", "anthropic-version": DEFAULT_VERSION}

    def key_headers(self) -> dict[str, str]:
        return {"x-api-key": self.settings.api_key} if self.settings.api_key else {}
