"""The Responses API over chat completions: requests, responses and streams translated both ways.

Pure functions over dicts, like ``protocol/chat.py``; the API layer does the I/O. Field names follow the
``openai`` SDK's ``types/responses`` (the tests validate every object and event made here against it).
``tools`` maps the client's tools to chat functions and back, ``validation`` checks requests,
``to_chat`` translates requests, ``from_chat`` responses, ``stream`` streams.
"""

from gateway.protocol.responses.from_chat import chat_to_response, failure_code, output_to_chat_messages, response_usage
from gateway.protocol.responses.stream import ResponseStream
from gateway.protocol.responses.to_chat import (
    LOCAL_SHELL_FUNCTION,
    conversation_messages,
    responses_to_chat,
)
from gateway.protocol.responses.tools import ToolEntry, ToolMap, custom_input, flat_name
from gateway.protocol.responses.validation import validate_responses_request

__all__ = [
    "LOCAL_SHELL_FUNCTION",
    "ResponseStream",
    "ToolEntry",
    "ToolMap",
    "chat_to_response",
    "conversation_messages",
    "custom_input",
    "failure_code",
    "flat_name",
    "output_to_chat_messages",
    "response_usage",
    "responses_to_chat",
    "validate_responses_request",
]
