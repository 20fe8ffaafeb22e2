"""Dependencies run one way: ``extras``, ``tools`` and ``replay`` at the bottom, ``gateway`` above them, ``training``
above that, and the command line (``harness``) on top.

Every import is counted, at module level or inside a function, type-checking ones included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"extras": 0, "tools": 0, "replay": 0, "gateway": 1, "training": 2, "harness": 3}


def modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def first_party_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] in LAYERS}


def test_dependencies_run_one_way() -> None:
    known = modules()
    wrong: set[str] = set()
    for module, path in sorted(known.items()):
        layer = LAYERS[module.split(".")[0]]
        for name in sorted(first_party_imports(path)):
            target = name if name in known else name.rsplit(".", 1)[0]
            if target not in known:
                continue
            if LAYERS[target.split(".")[0]] > layer:
                wrong.add(f"{module} imports {target}, a layer above it")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_walk_sees_the_packages() -> None:
    # A check that finds no module or no import would pass on anything.
    known = modules()
    assert {"gateway.app", "replay.store", "tools.ssrf", "training.sft", "harness.main"} <= set(known)
    # Nothing that reads like a command line is left outside the top layer.
    assert not [m for m in known if not m.startswith("harness") and m.rsplit(".", 1)[-1].endswith("cli")]
    assert "replay.store" in first_party_imports(known["gateway.app"])


def test_only_the_config_reads_the_environment() -> None:
    readers = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.add(module)
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    {alias.name for alias in node.names} & {"environ", "getenv", "environb"}:
                readers.add(module)
    assert readers == {"gateway.config"}, f"the environment is read outside the config: {sorted(readers)}"


# -- one owner of SQL --------------------------------------------------------------------------------------

SQL = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|REPLACE|CREATE|ALTER|DROP|PRAGMA|BEGIN|COMMIT)\b")
# Databases that are not the store: the sql_query tool's own database (read in its worker process), and the task
# suite's fixture database.
NOT_THE_STORE = {"tools.builtin.sql_worker", "training.tasks.tools_suite"}
STORE_PRIVATE = {"_select", "_change", "_change_returning", "_transaction"}


def sql_in(path: Path) -> list[str]:
    """SQL written in a module: string literals (f-strings' parts too) that read as statements, and uses of the
    store's private doors."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.match(node.value):
            found.append(f"line {node.lineno}: {node.value.strip()[:40]!r}")
        elif isinstance(node, ast.Attribute) and node.attr in STORE_PRIVATE and \
                not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_sql_against_the_store_is_written_in_replay_alone() -> None:
    outside = {module: hits for module, path in modules().items()
               if not module.startswith("replay") and module not in NOT_THE_STORE and (hits := sql_in(path))}
    assert not outside, "\n".join(f"{m}: {', '.join(h)}" for m, h in sorted(outside.items()))


def test_the_sql_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('ROWS = "SELECT * FROM trajectories"\n'
                       'def f(store, t):\n'
                       '    return store._select(f"UPDATE bot_messages SET status = {t}")\n')
    assert len(sql_in(planted)) == 3
    assert sql_in(ROOT / "replay" / "approvals.py")  # the repositories do hold SQL
    assert sql_in(ROOT / "tools" / "builtin" / "sql_worker.py")  # and so does the exempt tool's worker


def test_the_store_has_no_open_door() -> None:
    from replay.store import TrajectoryStore

    public = {name for name in vars(TrajectoryStore) if not name.startswith("_")}
    assert not public & {"query", "execute", "execute_returning", "transaction", "executemany"}, public
