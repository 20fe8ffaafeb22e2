"""convert_units: a unit converter for length, mass and temperature (the tools suite's test-only tool)."""

from __future__ import annotations

from typing import Any

from tools.context import ToolContext
from tools.registry import tool
from tools.spec import ToolError, ToolSpec

# Canonical unit → (dimension, size in the dimension's base unit); temperature is handled apart.
_LINEAR: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mm": ("length", 0.001),
    "mi": ("length", 1609.344), "ft": ("length", 0.3048), "in": ("length", 0.0254), "yd": ("length", 0.9144),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
}
_TEMPERATURE = ("C", "F", "K")

_ALIASES: dict[str, str] = {
    "meter": "m", "meters": "m", "metre": "m", "metres": "m",
    "kilometer": "km", "kilometers": "km", "kilometre": "km", "kilometres": "km",
    "centimeter": "cm", "centimeters": "cm", "centimetre": "cm", "centimetres": "cm",
    "millimeter": "mm", "millimeters": "mm", "millimetre": "mm", "millimetres": "mm",
    "mile": "mi", "miles": "mi", "foot": "ft", "feet": "ft", "inch": "in", "inches": "in",
    "yard": "yd", "yards": "yd",
    "kilogram": "kg", "kilograms": "kg", "kilo": "kg", "kilos": "kg", "gram": "g", "grams": "g",
    "pound": "lb", "pounds": "lb", "lbs": "lb", "ounce": "oz", "ounces": "oz",
    "c": "C", "celsius": "C", "degrees celsius": "C", "°c": "C",
    "f": "F", "fahrenheit": "F", "degrees fahrenheit": "F", "°f": "F",
    "k": "K", "kelvin": "K",
}
UNITS = (*_LINEAR, *_TEMPERATURE)


def canonical_unit(unit: str) -> str:
    """The canonical short name of ``unit`` (``kilometres`` → ``km``); a ToolError for an unknown unit."""
    text = unit.strip()
    if text in _LINEAR or text in _TEMPERATURE:
        return text
    found = _ALIASES.get(text.lower()) or (text.lower() if text.lower() in _LINEAR else None)
    if found is None:
        raise ToolError(f"unknown unit {unit!r} (known: {', '.join(UNITS)})")
    return found


def _to_kelvin(value: float, unit: str) -> float:
    return value + 273.15 if unit == "C" else (value - 32) * 5 / 9 + 273.15 if unit == "F" else value


def _from_kelvin(value: float, unit: str) -> float:
    return value - 273.15 if unit == "C" else (value - 273.15) * 9 / 5 + 32 if unit == "F" else value


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """``value`` in ``from_unit`` expressed in ``to_unit``; a ToolError when the units do not match."""
    source, target = canonical_unit(from_unit), canonical_unit(to_unit)
    if source in _TEMPERATURE or target in _TEMPERATURE:
        if not (source in _TEMPERATURE and target in _TEMPERATURE):
            raise ToolError(f"cannot convert {source} to {target}: one is a temperature and the other is not")
        return _from_kelvin(_to_kelvin(value, source), target)
    (source_dim, source_size), (target_dim, target_size) = _LINEAR[source], _LINEAR[target]
    if source_dim != target_dim:
        raise ToolError(f"cannot convert {source} ({source_dim}) to {target} ({target_dim})")
    return value * source_size / target_size


@tool(
    name="convert_units",
    description=("Convert a value from one unit to another. Length: m, km, cm, mm, mi, ft, in, yd; "
                 "mass: kg, g, lb, oz; temperature: C, F, K. Returns the converted value and its unit."),
    parameters={
        "type": "object",
        "properties": {
            "value": {"type": "number", "description": "the amount to convert, e.g. 5"},
            "from_unit": {"type": "string", "description": "the unit of the value, e.g. km"},
            "to_unit": {"type": "string", "description": "the unit wanted, e.g. mi"},
        },
        "required": ["value", "from_unit", "to_unit"],
        "additionalProperties": False,
    },
    timeout=5.0,
)
async def convert_units(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
    result = convert(float(arguments["value"]), arguments["from_unit"], arguments["to_unit"])
    return {"value": round(result, 4), "unit": canonical_unit(arguments["to_unit"])}


CONVERT_UNITS: ToolSpec = convert_units
