"""Signing in to the console, in a real browser: keys, sessions, sign-out, revocation, and the checks on forms."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.auth import hash_secret
from tests.gateway.console.conftest import ADMIN_KEY, Console, serve_console, sign_in
from tests.processes import harness_cli

pytestmark = [pytest.mark.integration]


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    yield from serve_console(tmp_path, ["Hello."])


def test_a_page_asks_for_sign_in_and_the_admin_key_opens_it(console: Console, page) -> None:
    page.goto(console.ui("/trajectories"))
    assert "/ui/login" in page.url
    page.fill("input[name=key]", "sk-wrong")
    page.click("button[type=submit]")
    assert page.locator("[role=alert]").inner_text() == "That key is not valid (or was revoked)."
    sign_in(page, console, ADMIN_KEY)
    assert page.locator("header .who").inner_text().startswith("admin")
    cookie = next(c for c in page.context.cookies() if c["name"] == "harness_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    # the store keeps the token's hash, never the token
    with sqlite3.connect(console.db) as db:
        stored = db.execute("SELECT id, key_id, admin FROM console_sessions").fetchall()
    assert stored == [(hash_secret(cookie["value"]), "admin", 1)]


def test_signing_out_ends_the_session_for_good(console: Console, page) -> None:
    sign_in(page, console, ADMIN_KEY)
    stolen = next(c for c in page.context.cookies() if c["name"] == "harness_console")["value"]
    page.click("text=Sign out")
    page.wait_for_url("**/ui/login")
    # the cookie's token no longer opens anything, even sent by hand
    response = httpx.get(console.ui("/trajectories"), cookies={"harness_console": stolen})
    assert response.status_code == 303 and "/ui/login" in response.headers["location"]


def test_a_revoked_key_ends_its_session(console: Console, page) -> None:
    key_id, secret = console.keys["acme"]
    sign_in(page, console, secret)
    assert "(acme)" in page.locator("header .who").inner_text()
    assert harness_cli(console.config, "keys", "revoke", key_id).returncode == 0
    page.goto(console.ui("/trajectories"))
    assert "/ui/login" in page.url


def test_a_form_without_its_token_or_from_another_site_is_refused(console: Console, page) -> None:
    sign_in(page, console, ADMIN_KEY)
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    url = console.ui("/logout")
    forged = httpx.post(url, cookies=cookies, data={"csrf": "guess"})
    assert forged.status_code == 403 and "security token" in forged.text
    elsewhere = httpx.post(url, cookies=cookies, data={}, headers={"origin": "https://evil.example"})
    assert elsewhere.status_code == 403 and "another site" in elsewhere.text
    # still signed in
    page.goto(console.ui("/trajectories"))
    assert page.url.endswith("/ui/trajectories")


def test_an_open_gateway_needs_no_sign_in_but_only_by_a_loopback_name(tmp_path: Path, page) -> None:
    for console in serve_console(tmp_path, ["Hello."], tenants=()):
        page.goto(console.ui())
        assert page.url.endswith("/ui/trajectories") and page.locator("header .who").inner_text() == "open gateway"
        # a page elsewhere that rebinds its own name to 127.0.0.1 reaches the port, but not the console
        port = console.url.rsplit(":", 1)[1]
        rebound = httpx.get(console.ui("/trajectories"), headers={"host": f"evil.example:{port}"})
        assert rebound.status_code == 303 and "/ui/login" in rebound.headers["location"]
        session = {c["name"]: c["value"] for c in page.context.cookies()}
        assert httpx.get(console.ui("/trajectories"), headers={"host": f"evil.example:{port}"},
                         cookies=session).status_code == 303


def test_a_session_expires(tmp_path: Path, page) -> None:
    for console in serve_console(tmp_path, ["Hello."], console_settings="session_hours = 0.0005"):  # 1.8 s
        sign_in(page, console, ADMIN_KEY)
        token = next(c for c in page.context.cookies() if c["name"] == "harness_console")["value"]
        assert httpx.get(console.ui("/trajectories"), cookies={"harness_console": token}).status_code == 200
        time.sleep(2.0)
        # the store ends it, whatever the browser keeps
        expired = httpx.get(console.ui("/trajectories"), cookies={"harness_console": token})
        assert expired.status_code == 303 and "/ui/login" in expired.headers["location"]
