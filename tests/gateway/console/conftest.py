"""The console in a real browser: a real gateway app on a loopback port (its model a scripted stand-in), Debian's
Chromium driven by Playwright, and a screenshot of every page a test ends on, kept as a test artefact
(``test-artifacts/console/``, or ``$HARNESS_TEST_ARTIFACTS/console/``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gateway.app import build_app
from gateway.config import load_settings
from tests.extras import skip_without
from tests.processes import create_key
from tests.scripted import SCRIPTED_BACKEND, ScriptedBackend, serve_scripted
from tests.standin import ServerThread

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ADMIN_KEY = "sk-admin-console-test"
ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = Path(os.environ.get("HARNESS_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "console"
CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

CONFIG = """
[server]
auth_cache_seconds = 0

[store]
path = "{db}"

[console]
approvers = {approvers}
{console_settings}
""" + SCRIPTED_BACKEND + """
[[profiles]]
name = "calc"
model = "scripted-model"
system_prompt = "You compute."
tools = ["calculator"]
max_steps = 6
"""


@dataclass
class Console:
    """A running gateway: its URL, its scripted model, its app, its config and store files, and its keys."""

    url: str
    backend: ScriptedBackend
    app: object
    config: Path
    db: Path
    keys: dict[str, tuple[str, str]]  # tenant -> (key id, secret)

    def ui(self, path: str = "") -> str:
        return f"{self.url}/ui{path}"


def serve_console(tmp_path: Path, script: list, *, tenants: tuple[str, ...] = ("acme", "globex"),
                  approvers: tuple[str, ...] = (), extra: str = "", console_settings: str = "",
                  keep_backends: tuple[str, ...] = ()) -> Iterator[Console]:
    """A gateway with the console, an admin key and one API key per tenant (so it is not an open gateway); its
    model answers with ``script``. ``approvers`` names tenants whose keys are console approvers;
    ``console_settings`` are more lines of its ``[console]`` table (``page_size = 3``); ``extra`` is appended to
    its config; ``keep_backends`` names backends of ``extra`` that start and serve beside the script (one that
    loads adapters)."""
    config = tmp_path / "h.toml"
    db = tmp_path / "h.db"
    config.write_text(CONFIG.format(db=db, approvers="[]", console_settings=console_settings) + extra)
    keys = {tenant: create_key(config, tenant) for tenant in tenants}
    approver_ids = [keys[t][0] for t in approvers]
    config.write_text(CONFIG.format(db=db, approvers=str(approver_ids).replace("'", '"'),
                                    console_settings=console_settings) + extra)
    app = build_app(load_settings(config, environ={"HARNESS_ADMIN_KEY": ADMIN_KEY}))
    backend = ScriptedBackend(script)
    kept = [b for b in app.state.gateway.backends if b.name in keep_backends]
    serve_scripted(app, backend)
    app.state.gateway.backends.extend(kept)
    with ServerThread(app, lifespan="on") as server:
        yield Console(server.url, backend, app, config, db, keys)


# Per module: Playwright's sync API keeps an event loop running in this thread while it is open, and the async tests
# of other modules need none running.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    skip_without("browse")  # here, not at import: the console's pure tests beside these need no browser
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context (no cookies) and page; the page it ends on is saved as a screenshot."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(10_000)
    yield tab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        tab.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
    finally:
        context.close()


def sign_in(page: Page, console: Console, key: str) -> None:
    page.goto(console.ui("/login"))
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/trajectories**")
