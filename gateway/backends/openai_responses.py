"""A Responses API upstream (``kind = "openai-responses"``), passed through (``passthrough.py``) for
``/v1/responses`` and ``/v1/responses/compact``: reasoning items with their ``encrypted_content``, custom tool
calls and compaction items reach the client as the upstream made them, and the client's ``prompt_cache_key``,
``previous_response_id`` and ``store`` reach the upstream as sent.

The upstream's own key (``api_key_env``) goes as a bearer token. The headers Codex and the OpenAI SDKs send to
shape or attribute a request (``openai-beta``, ``session_id``, ``originator``, ``x-codex-*`` ...) are forwarded.
"""

from __future__ import annotations

from gateway.backends.passthrough import PassThroughBackend


class ResponsesBackend(PassThroughBackend):
    API = "OpenAI Responses API"
    SERVED_ON = "/v1/responses"
    FORWARDED_HEADERS = ("openai-beta", "openai-organization", "openai-project", "session_id", "conversation_id",
                         "originator", "user-agent", "version", "chatgpt-account-id")
    FORWARDED_PREFIXES = ("x-codex-", "x-openai-", "x-stainless-")
    ANSWER_HEADERS = ("content-type", "x-request-id", "openai-processing-ms", "retry-after")
    ANSWER_PREFIXES = ("x-ratelimit-", "x-codex-")

    def key_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
