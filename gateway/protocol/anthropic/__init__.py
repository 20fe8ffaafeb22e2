"""The Anthropic Messages API and chat completions, translated both ways: pure functions, no I/O."""

from gateway.protocol.anthropic.errors import error_body, error_type_for
from gateway.protocol.anthropic.events import MessageAccumulator
from gateway.protocol.anthropic.from_chat import chat_to_message, message_to_chat, stop_reason, usage_of
from gateway.protocol.anthropic.sessions import session_id, side_request_kind
from gateway.protocol.anthropic.stream import MessageStream
from gateway.protocol.anthropic.to_chat import Translated, messages_to_chat
from gateway.protocol.anthropic.tokens import estimate_tokens
from gateway.protocol.anthropic.validation import validate_messages_request

__all__ = ["MessageAccumulator", "MessageStream", "Translated", "chat_to_message", "error_body", "error_type_for",
           "estimate_tokens", "message_to_chat", "messages_to_chat", "session_id", "side_request_kind",
           "stop_reason", "usage_of", "validate_messages_request"]
