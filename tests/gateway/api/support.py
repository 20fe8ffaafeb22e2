"""A real gateway app on a loopback port whose model is a scripted stand-in (tests/scripted.py): what the API tests
and bench/agent_loop.py serve."""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

from gateway.app import build_app
from gateway.config import load_settings
from tests.scripted import SCRIPTED_BACKEND, ScriptedBackend, call, serve_scripted
from tests.standin import ServerThread

CONFIG = """
[store]
path = "{db}"
""" + SCRIPTED_BACKEND + """
[[profiles]]
name = "calc"
model = "scripted-model"
system_prompt = "You compute."
tools = ["calculator"]
max_steps = 5
"""


def calculator_script() -> list:
    return [call("calculator", {"expression": "6*7"}), "The answer is 42."]


class Served:
    def __init__(self, url: str, backend: ScriptedBackend, app) -> None:
        self.url, self.backend, self.app = url, backend, app


def serve(tmp_path: Path, script: list) -> Iterator[Served]:
    cfg = tmp_path / "h.toml"
    cfg.write_text(CONFIG.format(db=tmp_path / "h.db"))
    app = build_app(load_settings(cfg, environ={}))
    backend = ScriptedBackend(script)
    serve_scripted(app, backend)
    with ServerThread(app, lifespan="on") as server:
        yield Served(server.url, backend, app)



def store_rows(db: Path, sql: str, args: tuple = ()) -> list[tuple]:
    """A query's rows from a gateway's SQLite store."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()
