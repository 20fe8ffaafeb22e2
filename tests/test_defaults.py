"""One default per knob: a setting's default is declared by its settings section alone.

Two ways a default gets repeated, each a test:
- a class built from a section (a ``from_settings`` class method: ``SFTConfig``, ``RLConfig``) gives a field of
  the section's a default of its own, which then drifts (``SFTConfig`` once trained at 2e-4 where ``[training]``
  said 2e-3);
- anywhere else in the product, a parameter or class field named as a setting repeats that setting's default as a
  literal (``Limits.max_steps = 10`` beside ``[[profiles]] max_steps``), where it should take the section's.

Falsy defaults (None, 0, False, empty) are not counted: they mean "none" or "off" wherever they appear.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("extras", "gateway", "tools", "replay", "training", "harness")


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def _sections() -> dict[type[BaseModel], dict[str, Any]]:
    """Every settings section of the product: the pydantic models of its settings and config modules."""
    sections: dict[type[BaseModel], dict[str, Any]] = {}
    for name, path in _modules():
        if path.stem not in ("settings", "config"):
            continue
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == name:
                sections[obj] = {f: info.get_default(call_default_factory=True)
                                 for f, info in obj.model_fields.items() if not info.is_required()}
    return sections


def test_classes_built_from_a_section_declare_none_of_its_defaults() -> None:
    # Read from the source, not imported: the training modules need torch, which a core install lacks.
    sections = {section.__name__: section for section in _sections()}
    builders = 0
    wrong = []
    for _, path in _modules():
        for cls in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(cls, ast.ClassDef):
                continue
            method = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "from_settings"), None)
            if method is None:
                continue
            builders += 1
            annotation = ast.unparse(method.args.args[1].annotation or ast.Constant(None))
            source = next((sections[name] for name in sections if name in annotation.split(" | ")), None)
            assert source is not None, f"{cls.name}.from_settings takes no known section ({annotation})"
            wrong += [f"{path.relative_to(ROOT)} {cls.name}.{st.target.id}" for st in cls.body
                      if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None
                      and st.target.id in source.model_fields]
    assert builders >= 2, "found too few classes built from a section: the check would pass on anything"
    assert not wrong, f"these repeat a default of the section they are built from: {wrong}"


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _NOT_LITERAL


_NOT_LITERAL = object()
# Same name and value as a setting, yet another knob, and why.
COINCIDENCES = {
    "gateway/backends/local/sampling.py SamplingParams.temperature": "OpenAI's default for a request, not RL's",
}


def _defaults(tree: ast.Module) -> list[tuple[int, str, str, Any]]:
    """(line, where, name, literal default) of every parameter and class field with a literal default."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
                     *((arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None)]
            out += [(node.lineno, node.name, arg.arg, _literal(d)) for arg, d in pairs]
        elif isinstance(node, ast.ClassDef):
            out += [(st.lineno, node.name, st.target.id, _literal(st.value)) for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None]
    return [d for d in out if d[3] is not _NOT_LITERAL]


def test_no_default_of_a_setting_is_written_again_elsewhere() -> None:
    defaults: dict[str, list[tuple[str, Any]]] = {}
    for section, fields in _sections().items():
        for name, value in fields.items():
            if value:  # falsy defaults mean "none" or "off" everywhere
                defaults.setdefault(name, []).append((section.__name__, value))
    assert {"max_steps", "learning_rate", "cache_entries"} <= set(defaults)  # the walk sees the sections
    repeated = []
    for _, path in _modules():
        if path.stem in ("settings", "config"):
            continue
        for line, where, name, value in _defaults(ast.parse(path.read_text(), str(path))):
            if f"{path.relative_to(ROOT)} {where}.{name}" in COINCIDENCES:
                continue
            for section, setting in defaults.get(name, ()):
                if value == setting and not isinstance(setting, BaseModel):
                    repeated.append(f"{path.relative_to(ROOT)}:{line} {where}.{name} = {value!r} "
                                    f"repeats {section}.{name}")
    assert not repeated, "defaults written again outside their section (take the section's):\n" + "\n".join(repeated)
