"""What the request checks share: values taken as the JSON has them, faults reported as OpenAI reports them.

OpenAI answers a malformed body with a 400 whose ``param`` names the field (``messages[2].tool_call_id``), whose
``code`` says what is wrong (``missing_required_parameter``, ``invalid_type``, ``invalid_value``), and it never
coerces: ``"stream": "yes"`` is refused, not read as true. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.errors import APIError


class Strict(BaseModel):
    # Unknown fields pass through to the backend; known ones are checked as the JSON has them, never coerced:
    # "1" is no number here, nor 1 a boolean.
    model_config = ConfigDict(extra="allow", strict=True)


class Fault(ValueError):
    """A check's own 400: its words and code, at ``loc`` below where the check ran."""

    def __init__(self, message: str, loc: Sequence[int | str] = (), code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.loc = tuple(loc)
        self.code = code


class Missing(Fault):
    """Raised by a check: the field counts as absent, and the 400 says it is missing."""

    def __init__(self, loc: Sequence[int | str] = ()) -> None:
        super().__init__("required", loc, code="missing_required_parameter")


def check_type(value: Any, models: Mapping[str, type[BaseModel]], allowed: Sequence[str] | None, what: str,
               default: str | None = None) -> Any:
    """Check an object by the model of its ``type`` (``default`` when it has none); a type not in ``allowed``
    is refused with the list of those that are (``None``: any type passes). Picked by a function rather than
    a pydantic union: a union's errors name its members in their location, not the field."""
    if not isinstance(value, dict):
        raise Fault(f"expected {what} object.", code="invalid_type")
    kind = value.get("type", default)
    if kind is None:
        raise Missing(("type",))
    if not isinstance(kind, str):
        raise Fault(f"expected a string, but got {_kind_of(kind)} instead.", ("type",), code="invalid_type")
    if allowed is not None and kind not in allowed:
        supported = ", ".join(f"'{a}'" for a in allowed)
        raise Fault(f"Invalid value: '{kind[:64]}'. Supported values are: {supported}.", ("type",))
    model = models.get(kind)
    if model is not None:
        model.model_validate(value)
    return value


def validate(model: type[BaseModel], body: Any) -> Any:
    """``model`` checked against a decoded body; the first fault as the 400 OpenAI sends."""
    if not isinstance(body, dict):
        raise APIError(400, "Request body must be a JSON object.", code="invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise first_error(exc) from None


def first_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc: tuple[int | str, ...] = tuple(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, Fault):
        loc += cause.loc
        if isinstance(cause, Missing):
            return request_error({"type": "missing"}, param_name(loc))
        param = param_name(loc)
        kind = "type" if cause.code == "invalid_type" else "value"
        return APIError(400, cause.message if cause.message[:1].isupper() else
                        f"Invalid {kind} for '{param}': {cause.message}", param=param, code=cause.code)
    if isinstance(cause, ValueError):
        err = {**err, "msg": str(cause)}
    return request_error(err, param_name(loc))


_EXPECTED = {"bool_type": "a boolean", "int_type": "an integer", "int_from_float": "an integer",
             "float_type": "a number", "string_type": "a string", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}


def request_error(err: Mapping[str, Any], param: str | None) -> APIError:
    """A validation error as the 400 OpenAI sends: missing, mistyped and invalid fields told apart."""
    kind = err["type"]
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    if kind in _EXPECTED:
        return APIError(400, f"Invalid type for '{param}': expected {_EXPECTED[kind]}, but got "
                             f"{_kind_of(err.get('input'))} instead.", param=param, code="invalid_type")
    if kind == "literal_error":
        expected = (err.get("ctx") or {}).get("expected", "")
        return APIError(400, f"Invalid value: {_shown(err.get('input'))}. Supported values are: {expected}.",
                        param=param, code="invalid_value")
    return APIError(400, f"Invalid value for '{param}': {err['msg']}", param=param, code="invalid_value")


def param_name(loc: Sequence[int | str]) -> str | None:
    """``("messages", 2, "tool_call_id")`` as OpenAI writes it: ``messages[2].tool_call_id``."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else part
    return param or None


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _shown(value: Any) -> str:
    return f"'{value[:64]}'" if isinstance(value, str) else _kind_of(value)
