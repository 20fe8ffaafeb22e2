"""Token budgets held before a call, not after: a call's completion is capped so that its prompt and completion
together fit what is left, and a call that cannot fit even one completion token is not made.

One mechanism for every budget that counts tokens: an agent run's ``max_total_tokens`` uses it before each model
call. The prompt's size comes from the backend's own tokenizer where it has one (the embedded model: exact), else
from an estimate, which can be off by the template's few tokens either way.
"""

from __future__ import annotations

from typing import Any


class BudgetExhausted(Exception):
    """Not one completion token fits: ``remaining`` tokens are left and the prompt alone takes ``prompt_tokens``."""

    def __init__(self, remaining: int, prompt_tokens: int) -> None:
        super().__init__(f"{remaining} tokens left, and the prompt alone takes {prompt_tokens}")
        self.remaining = remaining
        self.prompt_tokens = prompt_tokens


def cap_completion(body: dict[str, Any], *, remaining: int, prompt_tokens: int) -> int:
    """Lower ``body``'s completion limit (``max_completion_tokens`` where it has one, else ``max_tokens``) to what
    ``remaining`` leaves after the prompt; an absent limit becomes that room. Returns the limit the call goes with."""
    room = remaining - prompt_tokens
    if room < 1:
        raise BudgetExhausted(remaining, prompt_tokens)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    if not isinstance(asked, int) or isinstance(asked, bool) or asked > room:
        body[key] = room
    return body[key]
