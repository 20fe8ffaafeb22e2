"""The "Adding a tool" example in docs/tools.md must keep working."""

import re
from pathlib import Path

from tools.context import ToolContext
from tools.executor import execute

DOC = Path(__file__).resolve().parents[2] / "docs" / "tools.md"


async def test_adding_a_tool_example_runs() -> None:
    section = DOC.read_text().split("## Adding a tool", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    registry = namespace["registry"]
    assert "repeat" in registry and "calculator" in registry
    outcome = await execute(registry["repeat"], {"text": "hi", "times": 3}, ToolContext())
    assert (outcome.status, outcome.output) == ("ok", "hi hi hi")
    outcome = await execute(registry["repeat"], {"text": " "}, ToolContext())
    assert outcome.output == "Tool repeat failed: the text is blank"
