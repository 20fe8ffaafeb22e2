"""Tool specs and their executors: the registry, the built-ins, and the guards they run behind.

The agent loop needs ``default_registry(settings)`` once, a ``ToolContext(settings)`` for the
gateway's lifetime (``await context.aclose()`` on shutdown), and per run a ``Toolbox(registry,
context, profile_tools)`` offering ``schemas()``, ``openai_tools()``, ``validate()`` and ``execute()``.
"""

from tools.context import ToolContext
from tools.executor import ToolOutcome, execute, validate_arguments
from tools.registry import ToolRegistry, default_registry, tool
from tools.spec import ToolError, ToolSpec
from tools.ssrf import BlockedURL, SSRFGuard
from tools.toolbox import Toolbox

__all__ = [
    "BlockedURL", "SSRFGuard", "ToolContext", "ToolError", "ToolOutcome", "ToolRegistry", "ToolSpec", "Toolbox",
    "default_registry", "execute", "tool", "validate_arguments",
]
