"""send_message: a text message to a person in the company chat, through the bot's chat platform (WeCom).

Always waits for a person's approval first: a message, once sent, cannot be taken back.
"""

from __future__ import annotations

from typing import Any

from tools.context import ToolContext
from tools.settings import ToolsSettings
from tools.spec import ToolError, ToolSpec

MAX_TEXT = 4_000


async def _run(arguments: dict[str, Any], context: ToolContext) -> str:
    if context.messenger is None:
        raise ToolError("no chat platform is configured to send messages ([bot.wecom])")
    await context.messenger(arguments["to"], arguments["text"])
    return f"sent {len(arguments['text'])} characters to {arguments['to']}"


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="send_message",
        description="Send a text message to a person in the company chat, by their user id. A person approves "
                    "each message before it is sent.",
        parameters={
            "type": "object",
            "properties": {
                "to": {"type": "string", "minLength": 1, "maxLength": 256, "description": "the recipient's user id"},
                "text": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT},
            },
            "required": ["to", "text"],
            "additionalProperties": False,
        },
        run=_run,
        timeout=30.0,
        output_cap=settings.output_cap,
        permissions=frozenset({"network", "message:send"}),
        requires_approval=True,
    )
