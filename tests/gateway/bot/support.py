"""For the bot tests and bench/bot.py: a real gateway app on a loopback port with the bot configured, thinking with a
scripted stand-in model, and a loopback receiver for callbacks that fails as often as a test asks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import build_app
from gateway.bot.signing import signed_headers
from gateway.config import load_settings
from tests.scripted import SCRIPTED_BACKEND, ScriptedBackend, serve_scripted
from tests.standin import ServerThread

SECRET = "bot-shared-secret"
ADMIN = "admin-key-for-tests"
CONFIG = """
[store]
path = "{db}"
[tools]
workspace = "{workspace}"
approval_poll_seconds = 0.2
""" + SCRIPTED_BACKEND + """
[[profiles]]
name = "helper"
model = "scripted-model"
system_prompt = "You help."
tools = ["calculator", "write_file", "send_message"]
max_steps = 4
context_budget_tokens = 4000
[bot]
profile = "helper"
sync_timeout_seconds = {sync}
callback_allow_networks = ["127.0.0.0/8"]
callback_backoff_seconds = 0.05
rate_limit_messages = {rate}
{extra}
"""


class BotGateway:
    def __init__(self, url: str, backend: ScriptedBackend, app: Any) -> None:
        self.url, self.backend, self.app = url, backend, app

    def post(self, path: str, body: Any, *, client: httpx.Client | None = None) -> httpx.Response:
        """A request signed with the bot's secret."""
        raw = orjson.dumps(body)
        return (client or httpx).post(self.url + path, content=raw, timeout=30,
                                      headers=signed_headers(SECRET.encode(), raw, time.time()))

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=signed_headers(SECRET.encode(), b"", time.time()), timeout=30)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, **kw)


@contextmanager
def bot_gateway(tmp_path: Path, script: list, *, sync: float = 10.0, rate: int = 20, extra: str = "",
                env: dict[str, str] | None = None, delay: float = 0.0) -> Iterator[BotGateway]:
    """A gateway on ``tmp_path``'s store; entering it again on the same folder is a restart."""
    cfg = tmp_path / "h.toml"
    (tmp_path / "ws").mkdir(exist_ok=True)
    cfg.write_text(CONFIG.format(db=tmp_path / "h.db", workspace=tmp_path / "ws", sync=sync, rate=rate, extra=extra))
    app = build_app(load_settings(cfg, environ={"HARNESS_BOT_SECRET": SECRET, "HARNESS_ADMIN_KEY": ADMIN,
                                                **(env or {})}))
    backend = ScriptedBackend(script, delay=delay)
    serve_scripted(app, backend)
    with ServerThread(app, lifespan="on") as server:
        yield BotGateway(server.url, backend, app)


class Receiver:
    """Answers 503 to the first ``failures`` callbacks, then 200; keeps every request (headers, body)."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.app = Starlette(routes=[Route("/hook", self.hook, methods=["POST"])])

    async def hook(self, request: Request) -> Response:
        self.requests.append((dict(request.headers), await request.body()))
        if len(self.requests) <= self.failures:
            return Response(b"busy", status_code=503)
        return Response(b"ok")

    def wait(self, count: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.requests) < count:
            assert time.monotonic() < deadline, f"{len(self.requests)} callbacks, expected {count}"
            time.sleep(0.02)
