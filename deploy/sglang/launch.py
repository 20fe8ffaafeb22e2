#!/usr/bin/env python3
"""Start SGLang from one TOML file of launch flags (standard library only; run it with SGLang's own Python).

    python launch.py [--dry-run] [CONFIG] [EXTRA FLAGS...]

CONFIG defaults to $SGLANG_CONFIG, then sglang.toml beside this file. Each top-level key is a flag of
``python -m sglang.launch_server``: ``key = "v"`` gives ``--key v``, ``true`` a bare ``--key``, ``false`` nothing, a
list ``--key v1 v2`` (SGLang's list flags take all values after one flag; a repeated flag keeps only its last), and
an inline table one JSON value (``lora-paths = [{lora_name = "a", lora_path = "/p", pinned = true}]``). EXTRA FLAGS
are appended, so they win over the file (``--host 0.0.0.0`` in a container). The command is printed, then replaces
this process, so signals reach SGLang itself. ``--dry-run`` only prints it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

_KEY = re.compile(r"[a-z0-9][a-z0-9_-]*")


def _value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError(f"{key}: a list of booleans is not a flag value")
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"{key}: {value!r} ({type(value).__name__}) cannot be a flag value")


def build_argv(config: dict[str, Any]) -> list[str]:
    """The launch_server flags a config stands for, in the file's order."""
    argv: list[str] = []
    for key, value in config.items():
        if not _KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a flag name (lower-case letters, digits and dashes)")
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            if value:
                argv += [flag, *(_value(key, item) for item in value)]
        elif isinstance(value, dict):
            raise ValueError(f"[{key}]: a table is not a flag; write flags as top-level keys")
        else:
            argv += [flag, _value(key, value)]
    return argv


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def command(config_path: str | os.PathLike[str], extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *build_argv(load_config(config_path)), *(extra or [])]


def main(argv: list[str]) -> int:
    dry_run = bool(argv) and argv[0] == "--dry-run"
    if dry_run:
        argv = argv[1:]
    if argv and not argv[0].startswith("-"):
        config_path, extra = argv[0], argv[1:]
    else:
        config_path = os.environ.get("SGLANG_CONFIG") or str(Path(__file__).with_name("sglang.toml"))
        extra = argv
    try:
        cmd = command(config_path, extra)
    except (OSError, tomllib.TOMLDecodeError, ValueError) as exc:
        print(f"launch.py: {config_path}: {exc}", file=sys.stderr)
        return 2
    print("+ " + shlex.join(cmd), flush=True)
    if dry_run:
        return 0
    os.execv(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
