"""calculator: arithmetic on a parsed expression tree, never ``eval``.

Only numbers, + - * / // % **, unary signs, parentheses, a few math functions and constants are
understood; anything else is refused by name. Sizes are bounded so no expression can stall the
event loop (``9**9**9`` is refused before it is computed).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from tools.context import ToolContext
from tools.settings import ToolsSettings
from tools.spec import ToolError, ToolSpec

MAX_EXPRESSION_CHARS = 1_000
MAX_INT_BITS = 4_000  # about 1,200 decimal digits
MAX_ROUND_DIGITS = 100

Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS:
        raise ToolError(f"round() takes a whole number of digits between -{MAX_ROUND_DIGITS} and {MAX_ROUND_DIGITS}")
    return round(x, ndigits)


_FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int | None]] = {
    # name: (function, fewest arguments, most arguments or None for any)
    "sqrt": (math.sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 2, None),
    "max": (max, 2, None),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "log": (math.log, 1, 2),
    "log10": (math.log10, 1, 1),
    "log2": (math.log2, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
}

_NODE_NAMES = {
    ast.Attribute: "attribute access", ast.Subscript: "indexing", ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators", ast.Lambda: "lambdas", ast.IfExp: "conditional expressions",
    ast.NamedExpr: "assignment", ast.List: "lists", ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets",
    ast.ListComp: "comprehensions", ast.GeneratorExp: "comprehensions", ast.JoinedStr: "strings",
}


def _check(value: Any) -> Number:
    """Keeps every intermediate result a real number of bounded size."""
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError("the result is too large (more than about 1,200 digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is too large (overflow)" if math.isinf(value) else "the result is not a number")
    return value


def _power(base: Number, exponent: Number) -> Number:
    # Refuse before computing: a big integer power would hold the event loop for minutes.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > MAX_INT_BITS:
            raise ToolError(f"{base} ** {exponent} is too large to compute")
    return operator.pow(base, exponent)


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ToolError(f"{node.value!r} is not a number")
        return node.value
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
            raise ToolError(f"the operator {type(node.op).__name__} is not supported{hint}")
        left, right = _evaluate(node.left), _evaluate(node.right)
        symbol, func = op
        try:
            return _check(_power(left, right) if symbol == "**" else func(left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"the result of {symbol} is too large (overflow)") from None
    if isinstance(node, ast.UnaryOp):
        unary = _UNARY.get(type(node.op))
        if unary is None:
            raise ToolError(f"the operator {type(node.op).__name__} is not supported")
        return _check(unary(_evaluate(node.operand)))
    if isinstance(node, ast.Name):
        if node.id not in _CONSTANTS:
            raise ToolError(f"unknown name {node.id!r} (known constants: {', '.join(_CONSTANTS)})")
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        return _call(node)
    raise ToolError(f"{_NODE_NAMES.get(type(node), type(node).__name__)} is not allowed")


def _call(node: ast.Call) -> Number:
    if isinstance(node.func, ast.Attribute):
        raise ToolError("attribute access is not allowed")
    if not isinstance(node.func, ast.Name):
        raise ToolError("only the listed functions may be called, by name")
    name = node.func.id
    if name not in _FUNCTIONS:
        raise ToolError(f"the function {name!r} is not allowed (allowed: {', '.join(_FUNCTIONS)})")
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise ToolError(f"{name}() takes plain positional arguments only")
    func, fewest, most = _FUNCTIONS[name]
    if len(node.args) < fewest or (most is not None and len(node.args) > most):
        count = str(fewest) if fewest == most else f"{fewest} or more" if most is None else f"{fewest} to {most}"
        raise ToolError(f"{name}() takes {count} argument(s), got {len(node.args)}")
    args = [_evaluate(a) for a in node.args]
    try:
        return _check(func(*args))
    except ValueError as exc:
        raise ToolError(f"{name}() got an argument outside its domain ({exc})") from None
    except OverflowError:
        raise ToolError(f"the result of {name}() is too large (overflow)") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; a ``ToolError`` says what is wrong with a bad one."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"invalid expression: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ToolError("the expression is nested too deeply") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise ToolError("the expression is nested too deeply") from None


async def _run(arguments: dict[str, Any], context: ToolContext) -> str:
    return str(evaluate(arguments["expression"]))


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression exactly. Supports + - * / // % ** and parentheses, "
            f"the functions {', '.join(_FUNCTIONS)}, and the constants {', '.join(_CONSTANTS)}."
        ),
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (2 + 3) * sqrt(16)"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        run=_run,
        timeout=5.0,
        output_cap=settings.output_cap,
    )
