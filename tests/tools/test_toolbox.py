from gateway.config import ToolsSettings
from tools.context import ToolContext
from tools.registry import default_registry
from tools.toolbox import Toolbox


async def test_toolbox_is_what_a_run_may_use() -> None:
    context = ToolContext(ToolsSettings())
    box = Toolbox(default_registry(context.settings), context, ["calculator"])
    assert list(box.schemas()) == ["calculator"]
    assert [t["function"]["name"] for t in box.openai_tools()] == ["calculator"]
    outcome = await box.execute("calculator", {"expression": "6 * 7"})
    assert (outcome.status, outcome.output) == ("ok", "42")
    outcome = await box.execute("browse", {"url": "http://x"})
    assert (outcome.status, outcome.output) == ("error", "Tool browse failed: no such tool")
    await context.aclose()
