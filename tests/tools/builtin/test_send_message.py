"""send_message goes out through the context's messenger, and says so plainly when there is none."""

from gateway.config import ToolsSettings
from tools.builtin import send_message
from tools.context import ToolContext
from tools.executor import execute


async def test_without_a_chat_platform_the_tool_says_so() -> None:
    spec = send_message.build(ToolsSettings())
    assert spec.requires_approval
    async with ToolContext() as context:
        outcome = await execute(spec, {"to": "lisi", "text": "hi"}, context)
    assert (outcome.status, outcome.output) == (
        "error", "Tool send_message failed: no chat platform is configured to send messages ([bot.wecom])")


async def test_the_message_goes_through_the_messenger() -> None:
    sent = []

    async def messenger(to: str, text: str) -> None:
        sent.append((to, text))

    async with ToolContext() as context:
        context.messenger = messenger
        outcome = await execute(send_message.build(ToolsSettings()), {"to": "lisi", "text": "the report is ready"},
                                context)
    assert outcome.status == "ok" and outcome.output == "sent 19 characters to lisi"
    assert sent == [("lisi", "the report is ready")]
