"""How deeply a request's JSON nests: bounded where the body is read, before anything else sees it.

Deep nesting breaks things far from the door: orjson refuses to write JSON nested more than 254 levels (the
backend's request, the store's records), Python's ``json`` and ``jsonschema`` recurse until the interpreter's
limit, and a grammar compiler's cost grows with it. A request that passed the door and then failed there was
answered 500 and, worse, failed the store's group commit for every exchange batched with it. No client sends
anything close to the bound: OpenAI's own structured outputs allow five levels of schema nesting.
"""

from __future__ import annotations

from typing import Any

import orjson

# Levels of objects and arrays, the body itself being the first; a JSON Schema spends two per level it nests
# (``properties`` and the property's own schema), so this leaves schemas about 30 levels.
MAX_DEPTH = 64
# Fields whose string value is JSON of its own (tool-call arguments), checked as if it were nested in place.
_JSON_STRINGS = frozenset({"arguments"})


def too_deep(value: Any, limit: int = MAX_DEPTH) -> str | None:
    """The top-level field under which ``value`` nests deeper than ``limit`` levels (``""`` for the body as a
    whole), or None when it does not."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, top = stack.pop()
        if depth > limit:
            return top
        if type(node) is dict:
            for key, item in node.items():
                where = top or key
                if type(item) is dict or type(item) is list:
                    stack.append((item, depth + 1, where))
                elif key in _JSON_STRINGS and type(item) is str and item[:1] in ("{", "["):
                    try:
                        stack.append((orjson.loads(item), depth + 1, where))
                    except orjson.JSONDecodeError:
                        # Not JSON (the model wrote something else), or JSON nested deeper than orjson reads:
                        # the first is the model's business, the second is judged by its brackets alone.
                        if _brackets(item) + depth > limit:
                            return where
        elif type(node) is list:
            stack.extend((item, depth + 1, top) for item in node if type(item) is dict or type(item) is list)
    return None


def _brackets(text: str) -> int:
    """An upper bound on how deeply ``text`` would nest as JSON: its longest run of opening brackets, counted
    without parsing (brackets inside strings count too, which can only overstate it)."""
    deepest = depth = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
